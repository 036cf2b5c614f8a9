"""Llama family (Llama 2/3, SmolLM2, Mistral): the plain pre-norm decoder with a gated MLP.

What varies within the family and is honoured: ``hidden_act`` (any activation in
:mod:`.activations`), ``attention_bias`` (q, k, v and o), ``mlp_bias``, ``head_dim``, rope
scaling (linear, llama3, yarn), Mistral's ``sliding_window``. Refused: ``longrope`` and
``dynamic`` rope (HF switches frequencies at run time), ``pretraining_tp`` is ignored by HF too.
"""
from __future__ import annotations

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .decoder import DecoderModel
from .registry import register_model

_LLAMA_GGUF = GGUFArchitecture(config_class="LlamaConfig", permuted_qk=True)
_MISTRAL_GGUF = GGUFArchitecture(config_class="MistralConfig", permuted_qk=True)


@register_model("LlamaForCausalLM", "MistralForCausalLM", model_types=("llama", "mistral"),
                gguf={"llama": _LLAMA_GGUF, "mistral": _MISTRAL_GGUF})
class LlamaForCausalLM(DecoderModel):
    @classmethod
    def arch_fields(cls, config) -> dict:
        # HF Llama and Mistral build every layer alike, whatever a layer_types entry says; only
        # Mistral has a window.
        fields = dict(o_proj_bias=bool(getattr(config, "attention_bias", False)),
                      mlp_bias=bool(getattr(config, "mlp_bias", False)), layer_types=None)
        if config.model_type != "mistral":
            fields["sliding_window"] = None
        return fields
