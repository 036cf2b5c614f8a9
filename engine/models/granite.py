"""Granite (3.x dense): Llama with four scalars.

* ``embedding_multiplier`` scales the token embeddings,
* ``residual_multiplier`` scales each block's output before it joins the residual stream,
* ``attention_multiplier`` is the attention scale (instead of ``head_dim ** -0.5``),
* ``logits_scaling`` divides the logits.

``attention_bias`` puts biases on q, k, v and o; ``mlp_bias`` on gate, up and down. llama.cpp
converts Granite as Llama (q/k rows permuted) and stores the scalars as ``*_scale`` keys.
"""
from __future__ import annotations

from dataclasses import dataclass

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .arch import ArchConfig
from .decoder import DecoderLayer, DecoderModel
from .registry import register_model


@dataclass(slots=True)
class GraniteArch(ArchConfig):
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, arch: GraniteArch, layer_index: int, rotary, prefix: str = "") -> None:
        super().__init__(arch, layer_index, rotary, prefix)
        self.residual_multiplier = arch.residual_multiplier

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


def _gguf_config_fields(metadata) -> dict:
    return {"attention_multiplier": metadata.model_value("attention.scale", 1.0),
            "embedding_multiplier": metadata.model_value("embedding_scale", 1.0),
            "residual_multiplier": metadata.model_value("residual_scale", 1.0),
            "logits_scaling": metadata.model_value("logit_scale", 1.0)}


_GRANITE_GGUF = GGUFArchitecture(config_class="GraniteConfig", permuted_qk=True, config_fields=_gguf_config_fields)


@register_model("GraniteForCausalLM", model_types=("granite",), gguf={"granite": _GRANITE_GGUF})
class GraniteForCausalLM(DecoderModel):
    arch_class = GraniteArch
    layer_class = GraniteDecoderLayer

    @classmethod
    def arch_fields(cls, config) -> dict:
        return dict(embedding_multiplier=float(config.embedding_multiplier),
                    residual_multiplier=float(config.residual_multiplier),
                    attention_scale=float(config.attention_multiplier),
                    logits_scaling=float(config.logits_scaling),
                    o_proj_bias=bool(config.attention_bias), mlp_bias=bool(config.mlp_bias))

    def compute_logits(self, hidden):
        # HF divides; multiplying by the reciprocal would round differently.
        return self.lm_head(hidden) / self.arch.logits_scaling
