"""Llama family (Llama 2/3, SmolLM2, Mistral): the plain pre-norm decoder with a gated MLP.

What varies within the family and is honoured: ``hidden_act`` (any activation in
:mod:`.activations`), ``attention_bias`` (q, k, v and o), ``mlp_bias``, ``head_dim``, rope
scaling (linear, llama3, yarn), Mistral's ``sliding_window`` on every layer (Qwen2/Qwen3, which
subclass this, follow ``layer_types``). Refused with a ValueError naming the field: ``longrope``
and ``dynamic`` rope (HF switches frequencies at run time), activations outside
:mod:`.activations`, ``partial_rotary_factor`` != 1, a ``sliding_window`` on Llama and a
``layer_types`` list that is not uniform (HF's attention ignores both, its cache does not).
``pretraining_tp`` is ignored by HF too.
"""
from __future__ import annotations

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .activations import check_activation
from .decoder import DecoderModel, refuse_if
from .registry import register_model
from .rotary import rope_parameters

_LLAMA_GGUF = GGUFArchitecture(config_class="LlamaConfig", permuted_qk=True)
_MISTRAL_GGUF = GGUFArchitecture(config_class="MistralConfig", permuted_qk=True)


@register_model("LlamaForCausalLM", "MistralForCausalLM", model_types=("llama", "mistral"),
                gguf={"llama": _LLAMA_GGUF, "mistral": _MISTRAL_GGUF})
class LlamaForCausalLM(DecoderModel):
    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        check_activation(getattr(config, "hidden_act", "silu"), cls.__name__)
        # HF's Llama rotary ignores partial_rotary_factor for the default rope and fails on it for
        # scaled ones; either way, running a partial rotary would not be what HF runs.
        factor = rope_parameters(config)["partial_rotary_factor"]
        if factor != 1:
            raise ValueError(f"config.json: partial_rotary_factor={factor!r} is not supported by {cls.__name__} here")
        cls.check_window_fields(config)

    @classmethod
    def check_window_fields(cls, config) -> None:
        """Llama and Mistral: refuse window settings HF's attention ignores (Qwen overrides this)."""
        if config.model_type == "llama":
            # HF's Llama attention has no window, but its generation cache keeps only the last
            # `sliding_window` keys of layers it thinks slide: what HF runs then depends on the cache.
            refuse_if(config, "sliding_window", lambda window: window is not None, cls)
        # Llama and Mistral build every layer alike (Mistral's window on all); a layer_types list
        # saying otherwise would be followed by HF's cache but not by its attention.
        uniform = "sliding_attention" if config.model_type == "mistral" and getattr(config, "sliding_window", None) \
            else "full_attention"
        refuse_if(config, "layer_types", lambda kinds: kinds is not None and set(kinds) != {uniform}, cls)

    @classmethod
    def arch_fields(cls, config) -> dict:
        # HF Llama and Mistral build every layer alike, whatever a layer_types entry says; only
        # Mistral has a window.
        fields = dict(o_proj_bias=bool(getattr(config, "attention_bias", False)),
                      mlp_bias=bool(getattr(config, "mlp_bias", False)), layer_types=None)
        if config.model_type != "mistral":
            fields["sliding_window"] = None
        return fields
