"""OLMo 2: Llama with its norms moved behind the blocks, and q/k RMSNorm over whole projections.

A layer is ``h += post_attention_layernorm(attn(h)); h += post_feedforward_layernorm(mlp(h))``:
no norm in front of either block. The q and k norms normalize all of a token's queries (keys)
together, over ``num_heads * head_dim``, before the split into heads (Qwen3 norms each head).
That norm spans every head, so the projection cannot be split across tensor-parallel ranks.
"""
from __future__ import annotations

import torch
from torch import nn

from hearth_llm import kernels
from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .attention import Attention
from .decoder import DecoderModel
from .mlp import GatedMLP
from .norms import RMSNorm
from .registry import register_model


class Olmo2Attention(Attention):
    def __init__(self, *args, rms_norm_eps: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        qkv = self.qkv_proj
        self.q_size, self.kv_size = qkv.num_heads * self.head_dim, qkv.num_kv_heads * self.head_dim
        self.q_norm = RMSNorm(self.q_size, rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, rms_norm_eps)

    def forward(self, positions, hidden, kv_cache, meta):
        if self.qkv_proj.parallel.size != 1:
            raise ValueError("Olmo2ForCausalLM: its q/k norms span all heads; tensor parallelism is not supported")
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qkv = torch.cat((self.q_norm(query), self.k_norm(key), value), dim=-1)
        key_cache, value_cache = kv_cache
        kv_scales = self.kv_scales_for(key_cache)
        query = kernels.qk_norm_rope_and_cache(qkv, positions, self.rotary.cos_sin_cache, key_cache, value_cache,
                                               meta.slot_mapping, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads,
                                               kv_scales=kv_scales)
        out = kernels.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.context_lens,
                                      meta.query_start_loc, meta.max_query_len, meta.max_context_len, self.scale,
                                      self.sliding_window, kv_scales=kv_scales)
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, arch, layer_index: int, rotary, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = Olmo2Attention.from_arch(arch, layer_index, rotary, prefix=f"{prefix}.self_attn",
                                                  rms_norm_eps=arch.rms_norm_eps)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.mlp_bias,
                            prefix=f"{prefix}.mlp", owner=arch.architecture)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        # The previous layer hands over its normed MLP output and the stream it is to be added to.
        if residual is not None:
            hidden = hidden + residual
        residual = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


_OLMO2_GGUF = GGUFArchitecture(config_class="Olmo2Config", tensor_names={
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"})


@register_model("Olmo2ForCausalLM", model_types=("olmo2",), gguf={"olmo2": _OLMO2_GGUF})
class Olmo2ForCausalLM(DecoderModel):
    layer_class = Olmo2DecoderLayer

    @classmethod
    def arch_fields(cls, config) -> dict:
        # attention_bias puts biases on q, k, v and o.
        return dict(o_proj_bias=bool(config.attention_bias))
