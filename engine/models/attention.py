"""Attention over the paged KV cache, with the knobs architectures differ in: biases, q/k norm,
sliding window per layer, attention logit soft-capping, a custom scale, partial or GPT-J rotary.

>>> attn = Attention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rotary=rotary)
>>> out = attn(positions, hidden, (key_cache, value_cache), meta)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hearth_llm import kernels
from hearth_llm.kernels.attention import flash_prefill
from hearth_llm.kernels.attention.flash_prefill import FlashPrefillPlan

from .linear import QKVLinear, RowLinear
from .norms import RMSNorm
from .rotary import RotaryEmbedding


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache; built once per step by the model runner."""

    slot_mapping: torch.Tensor      # [T] flat cache slot of each new token
    block_tables: torch.Tensor      # [B, max_blocks] block ids of each sequence
    context_lens: torch.Tensor      # [B] tokens in cache after this step
    query_start_loc: torch.Tensor   # [B + 1] where each sequence's new tokens start in the flat batch
    max_query_len: int
    max_context_len: int
    # [B] tokens each sequence has in all (prompt, output, one in flight), when the runner knows:
    # Phi-3's longrope picks its factors by it. None (decode graphs): read context_lens.
    seq_lens: torch.Tensor | None = None
    # Which sequences run on FlashAttention-2 this step (long prefills and chunks, CUDA): built
    # by the runner from host lengths; None: every sequence runs on kernels.paged_attention.
    flash_prefill: FlashPrefillPlan | None = None


class Attention(nn.Module):
    """``o_proj(attention(rotary(q), rotary(k), v))`` with keys and values written to the cache.

    ``q_norm``/``k_norm`` are per-head norms applied before rotary (Qwen3, Gemma 3, OLMo 2 use
    their own shapes of them; pass RMSNorm modules over ``head_dim`` here, or None). ``scale``
    defaults to ``head_dim ** -0.5``; ``soft_cap`` caps attention logits as ``c * tanh(s / c)``.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, *, qkv_bias: bool = False, o_bias: bool = False,
                 sliding_window: int | None = None, soft_cap: float | None = None, scale: float | None = None,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, prefix: str = "") -> None:
        super().__init__()
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        self.qkv_proj = QKVLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias,
                                  prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowLinear(num_heads * head_dim, hidden_size, bias=o_bias, prefix=f"{prefix}.o_proj")
        self.rotary = rotary
        self.q_norm, self.k_norm = q_norm, k_norm
        self._kv_scales: torch.Tensor | None = None

    @classmethod
    def from_arch(cls, arch, layer_index: int, rotary: RotaryEmbedding, prefix: str = "", **overrides) -> "Attention":
        """The attention layer ``arch`` describes for layer ``layer_index``; keyword overrides win."""
        kwargs = dict(
            qkv_bias=arch.attention_bias, o_bias=arch.o_proj_bias, sliding_window=arch.sliding_window_for(layer_index),
            soft_cap=arch.attn_logit_softcap, scale=arch.scale,
        )
        if arch.has_qk_norm:
            kwargs.update(q_norm=RMSNorm(arch.head_dim, arch.rms_norm_eps), k_norm=RMSNorm(arch.head_dim, arch.rms_norm_eps))
        kwargs.update(overrides)
        return cls(arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, rotary,
                   prefix=prefix, **kwargs)

    def kv_scales_for(self, key_cache: torch.Tensor) -> torch.Tensor | None:
        """This layer's (key scale, value scale) for an fp8 cache, else None. Fixed at 1.0, vLLM's
        default without calibrated scales; one tensor per layer, made on the first (eager) step so
        CUDA graphs captured later read it in place."""
        if key_cache.dtype != torch.float8_e4m3fn:
            return None
        if self._kv_scales is None or self._kv_scales.device != key_cache.device:
            self._kv_scales = torch.ones(2, dtype=torch.float32, device=key_cache.device)
        return self._kv_scales

    def forward(self, positions, hidden, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        return self.attend(positions, self.qkv_proj(hidden), kv_cache, meta)

    def attend(self, positions, qkv, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        """The layer from its projected ``qkv`` on (a caller may have fused the projection with the norm before it)."""
        return self.o_proj(self.attend_heads(positions, qkv, kv_cache, meta))

    def attend_heads(self, positions, qkv, kv_cache: tuple[torch.Tensor, torch.Tensor],
                     meta: AttentionMetadata) -> torch.Tensor:
        """:meth:`attend` without ``o_proj``: the heads' outputs ``[T, H * D]``."""
        num_tokens = qkv.shape[0]
        qkv_proj, rotary = self.qkv_proj, self.rotary  # each a module lookup: once per step
        num_heads, num_kv_heads = qkv_proj.num_heads_per_rank, qkv_proj.num_kv_heads_per_rank
        key_cache, value_cache = kv_cache
        has_qk_norm = self.q_norm is not None
        kv_scales = self.kv_scales_for(key_cache)
        # Split heads, q/k norm, rotary and the cache write: one kernel on CUDA.
        query = kernels.qk_norm_rope_and_cache(
            qkv, positions, rotary.cos_sin_cache, key_cache, value_cache, meta.slot_mapping,
            num_heads, num_kv_heads, self.q_norm.weight if has_qk_norm else None,
            self.k_norm.weight if has_qk_norm else None, self.q_norm.eps if has_qk_norm else 1e-6,
            rotary.is_neox_style, kv_scales,
        )
        out = paged_attention(query, key_cache, value_cache, meta, self.scale, self.sliding_window, self.soft_cap,
                              kv_scales)
        return out.reshape(num_tokens, num_heads * self.head_dim)


def paged_attention(query, key_cache, value_cache, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None, soft_cap: float | None, kv_scales: torch.Tensor | None):
    """``kernels.paged_attention`` over ``meta``; the step's long prefills on FlashAttention-2 when
    the runner planned them and this layer's options allow it (see ``kernels/attention/flash_prefill.py``)."""
    plan = meta.flash_prefill
    if plan is not None and flash_prefill.ENABLED and flash_prefill.supports(query, key_cache, value_cache, soft_cap,
                                                                             kv_scales):
        try:
            return flash_prefill.paged_attention(query, key_cache, value_cache, plan, scale, sliding_window,
                                                 attend_rest=kernels.paged_attention)
        except RuntimeError as error:  # the op refused these inputs (its checks run before any kernel)
            flash_prefill.disable(f"{type(error).__name__}: {error}")
    return kernels.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.context_lens,
                                   meta.query_start_loc, meta.max_query_len, meta.max_context_len, scale,
                                   sliding_window, soft_cap, kv_scales)
