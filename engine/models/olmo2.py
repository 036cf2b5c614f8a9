"""OLMo 2: Llama with its norms moved behind the blocks, and q/k RMSNorm over whole projections.

A layer is ``h += post_attention_layernorm(attn(h)); h += post_feedforward_layernorm(mlp(h))``:
no norm in front of either block. The q and k norms normalize all of a token's queries (keys)
together, over ``num_heads * head_dim``, before the split into heads (Qwen3 norms each head).
That norm spans every head: under tensor parallelism each rank sums the squares of its slice, one
all-reduce adds the ranks' sums, and each rank scales by its slice of the (whole, replicated) weight.
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
        qkv_proj = self.qkv_proj
        if qkv_proj.parallel.size == 1:
            query, key, value = qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat((self.q_norm(query), self.k_norm(key), value), dim=-1)
        else:
            qkv = self._split_norms(qkv_proj(hidden))
        key_cache, value_cache = kv_cache
        kv_scales = self.kv_scales_for(key_cache)
        query = kernels.qk_norm_rope_and_cache(qkv, positions, self.rotary.cos_sin_cache, key_cache, value_cache,
                                               meta.slot_mapping, qkv_proj.num_heads_per_rank,
                                               qkv_proj.num_kv_heads_per_rank,
                                               kv_scales=kv_scales)
        out = kernels.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.context_lens,
                                      meta.query_start_loc, meta.max_query_len, meta.max_context_len, self.scale,
                                      self.sliding_window, kv_scales=kv_scales)
        return self.o_proj(out.reshape(hidden.shape[0], qkv_proj.num_heads_per_rank * self.head_dim))

    def _split_norms(self, qkv: torch.Tensor) -> torch.Tensor:
        """The q/k RMSNorms of this rank's slice of the projection, over the WHOLE q (k) widths.

        Every rank holds as many q (k) values as the others, so the whole mean of squares is the
        all-reduced sum over ``width * size``; replicated key heads (fewer than the ranks) are
        counted once per copy on both sides of that division, so the mean stays exact.
        """
        qkv_proj, head_dim = self.qkv_proj, self.head_dim
        q_width, kv_width = qkv_proj.num_heads_per_rank * head_dim, qkv_proj.num_kv_heads_per_rank * head_dim
        query, key, value = qkv.split([q_width, kv_width, kv_width], dim=-1)
        query, key = query.float(), key.float()
        sums = torch.stack((query.square().sum(-1), key.square().sum(-1)), dim=-1)  # one all-reduce for both
        qkv_proj.parallel.all_reduce(sums)
        size = qkv_proj.parallel.size
        q_first, k_first = qkv_proj.rank_rows("q")[0], qkv_proj.rank_rows("k")[0]
        query = query * torch.rsqrt(sums[:, :1] / (q_width * size) + self.q_norm.eps)
        key = key * torch.rsqrt(sums[:, 1:] / (kv_width * size) + self.k_norm.eps)
        query = (query * self.q_norm.weight.narrow(0, q_first, q_width).float()).to(qkv.dtype)
        key = (key * self.k_norm.weight.narrow(0, k_first, kv_width).float()).to(qkv.dtype)
        return torch.cat((query, key, value), dim=-1)


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
