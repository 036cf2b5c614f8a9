"""Gemma 2: Gemma with attention and final logit soft-capping (``c * tanh(x / c)``), queries
scaled by ``query_pre_attn_scalar ** -0.5``, a norm after attention and on both sides of the
feed-forward block, and a sliding window on the layers ``layer_types`` marks (every other one).

In bf16, HF's eager attention caps scores computed in bf16 and its final cap works on bf16 logits;
our attention kernels cap float32 scores, and on the CPU the logits head returns float32 logits
(``CpuLogitsHead``): closer to the fp32 model than HF's bf16 run, not bit-equal to it.
"""
from __future__ import annotations

from torch import nn

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .attention import Attention
from .gemma import GemmaModelBase, gemma_norm, minus_one_on_norms
from .mlp import GatedMLP
from .registry import register_model

# llama.cpp names for Gemma 2/3's extra norms (its "ffn_norm" is the pre-feed-forward one here).
GEMMA2_GGUF_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_query_pre_attn_scalar(metadata, num_layers_of_27b: int) -> float:
    """llama.cpp keeps no ``query_pre_attn_scalar``: it scales by ``head_dim`` except in the 27B
    models (told apart by their layer count), which use ``hidden_size / num_heads``."""
    if metadata.model_value("block_count") == num_layers_of_27b:
        return metadata.model_value("embedding_length") / metadata.model_value("attention.head_count")
    return metadata.model_value("attention.key_length")


def _gemma2_gguf_fields(metadata) -> dict:
    return dict(attn_logit_softcapping=metadata.model_value("attn_logit_softcapping", None),
                final_logit_softcapping=metadata.model_value("final_logit_softcapping", None),
                sliding_window=metadata.model_value("attention.sliding_window"),
                query_pre_attn_scalar=gguf_query_pre_attn_scalar(metadata, num_layers_of_27b=46))


class Gemma2DecoderLayer(nn.Module):
    """``h += post_attn_norm(attn(norm(h))); h += post_ffw_norm(mlp(pre_ffw_norm(h)))``."""

    def __init__(self, arch, layer_index: int, rotary, prefix: str = "", **attention_overrides) -> None:
        super().__init__()
        self.self_attn = Attention.from_arch(arch, layer_index, rotary, prefix=f"{prefix}.self_attn",
                                             **attention_overrides)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, prefix=f"{prefix}.mlp",
                            owner=arch.architecture)
        self.input_layernorm = gemma_norm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = gemma_norm(arch.hidden_size, arch.rms_norm_eps)
        self.pre_feedforward_layernorm = gemma_norm(arch.hidden_size, arch.rms_norm_eps)
        self.post_feedforward_layernorm = gemma_norm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


@register_model("Gemma2ForCausalLM", model_types=("gemma2",), gguf={"gemma2": GGUFArchitecture(
    config_class="Gemma2Config", tensor_names=GEMMA2_GGUF_NORMS, config_fields=_gemma2_gguf_fields,
    transform_tensor=minus_one_on_norms)})
class Gemma2ForCausalLM(GemmaModelBase):
    layer_class = Gemma2DecoderLayer

    @classmethod
    def arch_fields(cls, config) -> dict:
        return dict(super().arch_fields(config), attention_scale=config.query_pre_attn_scalar**-0.5,
                    attn_logit_softcap=config.attn_logit_softcapping,
                    final_logit_softcap=config.final_logit_softcapping)
