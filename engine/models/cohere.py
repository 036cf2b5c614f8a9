"""Cohere / Command-R: attention and MLP side by side off one bias-free LayerNorm
(``h += attn(ln(h)) + mlp(ln(h))``), GPT-J style (interleaved) rotary, logits multiplied by
``logit_scale``, the head tied to the embedding by default. Command-R+ (``use_qk_norm``) adds a
bias-free LayerNorm over each head's queries and keys, with its own weight row per head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hearth_llm import kernels
from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .arch import ArchConfig
from .attention import Attention
from .decoder import DecoderModel
from .mlp import GatedMLP
from .norms import LayerNorm
from .registry import register_model


@dataclass(slots=True)
class CohereArch(ArchConfig):
    use_qk_norm: bool = False


class PerHeadLayerNorm(nn.Module):
    """LayerNorm of ``[T, H, D]`` heads over D, each head scaled by its row of ``weight`` ``[H, D]``
    (in float32, as HF's CohereLayerNorm)."""

    def __init__(self, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, first_head: int = 0) -> torch.Tensor:
        """``first_head``: the row of ``weight`` that ``x``'s first head uses (a tensor-parallel
        rank holds heads ``first_head .. first_head + H``)."""
        normed = F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps)
        weight = self.weight.narrow(0, first_head, x.shape[-2])
        return (normed * weight.float()).to(x.dtype)


class CohereQKNormAttention(Attention):
    """Command-R+: per-head LayerNorm of queries and keys before rotary."""

    def __init__(self, *args, qk_norm_eps: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        qkv = self.qkv_proj
        self.q_norm = PerHeadLayerNorm(qkv.num_heads, self.head_dim, qk_norm_eps)
        self.k_norm = PerHeadLayerNorm(qkv.num_kv_heads, self.head_dim, qk_norm_eps)

    def forward(self, positions, hidden, kv_cache, meta):
        # Under tensor parallelism this rank holds some query heads and some (maybe replicated) key
        # heads; the norm weights stay whole (tiny) and each rank scales by its heads' rows.
        qkv = self.qkv_proj
        num_tokens, num_heads, num_kv_heads = hidden.shape[0], qkv.num_heads_per_rank, qkv.num_kv_heads_per_rank
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        query, key, value = qkv(hidden).split([q_size, kv_size, kv_size], dim=-1)
        query = self.q_norm(query.view(num_tokens, num_heads, self.head_dim),
                            first_head=qkv.rank_rows("q")[0] // self.head_dim).flatten(1)
        key = self.k_norm(key.view(num_tokens, num_kv_heads, self.head_dim),
                          first_head=qkv.rank_rows("k")[0] // self.head_dim).flatten(1)
        key_cache, value_cache = kv_cache
        kv_scales = self.kv_scales_for(key_cache)
        query = kernels.qk_norm_rope_and_cache(torch.cat((query, key, value), dim=-1), positions,
                                               self.rotary.cos_sin_cache, key_cache, value_cache, meta.slot_mapping,
                                               num_heads, num_kv_heads, is_neox_style=False, kv_scales=kv_scales)
        out = kernels.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.context_lens,
                                      meta.query_start_loc, meta.max_query_len, meta.max_context_len, self.scale,
                                      self.sliding_window, kv_scales=kv_scales)
        return self.o_proj(out.reshape(num_tokens, q_size))


class CohereDecoderLayer(nn.Module):
    def __init__(self, arch: CohereArch, layer_index: int, rotary, prefix: str = "") -> None:
        super().__init__()
        if arch.use_qk_norm:
            self.self_attn = CohereQKNormAttention.from_arch(arch, layer_index, rotary, prefix=f"{prefix}.self_attn",
                                                             qk_norm_eps=arch.rms_norm_eps)
        else:
            self.self_attn = Attention.from_arch(arch, layer_index, rotary, prefix=f"{prefix}.self_attn")
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.mlp_bias,
                            prefix=f"{prefix}.mlp", owner=arch.architecture)
        self.input_layernorm = LayerNorm(arch.hidden_size, arch.rms_norm_eps, bias=False)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        return self.self_attn(positions, normed, kv_cache, meta) + self.mlp(normed), residual


_COMMAND_R_GGUF = GGUFArchitecture(
    config_class="CohereConfig",
    config_fields=lambda metadata: {"logit_scale": metadata.model_value("logit_scale"),
                                    "layer_norm_eps": metadata.model_value("attention.layer_norm_epsilon")})


@register_model("CohereForCausalLM", model_types=("cohere",), gguf={"command-r": _COMMAND_R_GGUF})
class CohereForCausalLM(DecoderModel):
    arch_class = CohereArch
    layer_class = CohereDecoderLayer

    @classmethod
    def arch_fields(cls, config) -> dict:
        return dict(is_neox_style=False, logits_multiplier=float(config.logit_scale),
                    use_qk_norm=bool(config.use_qk_norm), o_proj_bias=bool(config.attention_bias))

    def make_norm(self) -> nn.Module:
        return LayerNorm(self.arch.hidden_size, self.arch.rms_norm_eps, bias=False)
