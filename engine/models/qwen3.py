"""Qwen3: Llama with RMSNorm on each head's queries and keys before rotary, no q/k/v biases
unless ``attention_bias``, windows as Qwen2."""
from __future__ import annotations

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .llama import LlamaForCausalLM
from .registry import register_model


@register_model("Qwen3ForCausalLM", model_types=("qwen3",), gguf={"qwen3": GGUFArchitecture(config_class="Qwen3Config")})
class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def check_window_fields(cls, config) -> None:
        pass  # HF's Qwen attention follows layer_types and sliding_window per layer, as ArchConfig does

    @classmethod
    def arch_fields(cls, config) -> dict:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return dict(has_qk_norm=True, o_proj_bias=attention_bias,
                    max_window_layers=getattr(config, "max_window_layers", None))
