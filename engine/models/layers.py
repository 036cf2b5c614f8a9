"""Layers shared by every decoder model: norms, rotary, attention over the paged cache, MLP."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hearth_llm import kernels
from hearth_llm.kernels import cpu_ops

from .arch import ArchConfig


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache; built once per step by the model runner."""

    slot_mapping: torch.Tensor      # [T] flat cache slot of each new token
    block_tables: torch.Tensor      # [B, max_blocks] block ids of each sequence
    context_lens: torch.Tensor      # [B] tokens in cache after this step
    query_start_loc: torch.Tensor   # [B + 1] where each sequence's new tokens start in the flat batch
    max_query_len: int
    max_context_len: int


class CpuLinear(nn.Module):
    """A bf16 ``nn.Linear`` whose weight is repacked for CPU matmuls; made by :func:`repack_for_cpu`.

    Batches use a copy of the weight in oneDNN's blocked layout. Steps of a few rows (decoding a
    few sequences) are bound by reading the weight from memory, so when the weight is already on a
    4-bit grid (dequantized from a Q4 GGUF file) they read a 4-bit copy: a quarter of the bytes,
    the same values.
    """

    # Above this many rows the 4-bit kernel's unpacking costs more than its smaller reads save.
    INT4_MAX_ROWS = 4

    def __init__(self, linear: nn.Linear, packed_weight: torch.Tensor, int4: tuple | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = packed_weight
        self.int4 = int4
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None and x.shape[0] <= self.INT4_MAX_ROWS:
            return cpu_ops.int4_linear(x, *self.int4, bias=self.bias)
        return cpu_ops.dense_linear(x, self.packed_weight, self.bias)


class CpuLogitsHead(nn.Module):
    """The vocabulary projection of a bf16 model on the CPU, with float32 logits.

    Logits rounded to bf16 lie 1/16 apart near typical top values, so greedy choices between close
    tokens would follow the rounding. A step of a few rows reads the weight from fbgemm's fp16 copy,
    which is both faster and more exact. Larger batches use the bf16 copy and then recompute their
    ``NUM_EXACT_TOP`` best logits in float32, where every choice is made.
    """

    FP16_MAX_ROWS = 4
    NUM_EXACT_TOP = 8

    def __init__(self, linear: nn.Linear, packed_weight: torch.Tensor, fp16_weight) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # tied models share it with the embedding: no copy
        self.packed_weight = packed_weight
        self.fp16_weight = fp16_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp16_weight is not None and x.shape[0] <= self.FP16_MAX_ROWS:
            return cpu_ops.fp16_linear(x, self.fp16_weight)
        logits = cpu_ops.dense_linear(x, self.packed_weight).float()
        top = cpu_ops.topk_indices(logits, min(self.NUM_EXACT_TOP, logits.shape[-1]))
        exact = torch.linalg.vecdot(self.weight[top].float(), x.float()[:, None, :])
        return logits.scatter_(1, top, exact)


def repack_for_cpu(model: nn.Module, logits_head: str = "lm_head") -> None:
    """Swap each bf16 ``nn.Linear`` of a model on the CPU for a :class:`CpuLinear`, and the one named
    ``logits_head`` for a :class:`CpuLogitsHead`. Other models are left as they are (float32 stays
    on the exact path the HF-equality tests pin down)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            packed_weight = cpu_ops.pack_dense_weight(child.weight)
            if packed_weight is None:
                continue
            if parent is model and name == logits_head and child.bias is None:
                setattr(parent, name, CpuLogitsHead(child, packed_weight, cpu_ops.pack_fp16_weight(child.weight)))
            else:
                setattr(parent, name, CpuLinear(child, packed_weight, cpu_ops.int4_weight_if_lossless(child.weight)))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without a residual returns the normed tensor; with one, ``(normed, x + residual)``."""
        normed, summed = kernels.rms_norm(x, self.weight, self.eps, residual)
        return normed if residual is None else (normed, summed)


class RotaryEmbedding(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        positions = torch.arange(arch.max_position_embeddings, dtype=torch.float32, device=arch.rope_inv_freq.device)
        freqs = torch.outer(positions, arch.rope_inv_freq.float())
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * arch.rope_attention_scaling
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions, query, key):
        return kernels.rotary_embedding(query, key, positions, self.cos_sin_cache)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = arch.sliding_window_for(layer_index)
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.rotary = rotary
        if arch.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions, hidden, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        key_cache, value_cache = kv_cache
        has_qk_norm = self.q_norm is not None
        # Split heads, q/k norm, rotary and the cache write: one kernel on CUDA.
        query = kernels.qk_norm_rope_and_cache(
            qkv, positions, self.rotary.cos_sin_cache, key_cache, value_cache, meta.slot_mapping,
            self.num_heads, self.num_kv_heads, self.q_norm.weight if has_qk_norm else None,
            self.k_norm.weight if has_qk_norm else None, self.q_norm.eps if has_qk_norm else 1e-6,
        )
        out = kernels.paged_attention(
            query, key_cache, value_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
            meta.max_query_len, meta.max_context_len, self.scale, self.sliding_window,
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_index, rotary)
        self.mlp = GatedMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
