"""Qwen2 / Qwen2.5: Llama with biases on q, k and v, and a sliding window on the layers
``layer_types`` marks (by default those from ``max_window_layers`` on, when ``use_sliding_window``)."""
from __future__ import annotations

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .llama import LlamaForCausalLM
from .registry import register_model


@register_model("Qwen2ForCausalLM", model_types=("qwen2",), gguf={"qwen2": GGUFArchitecture(config_class="Qwen2Config")})
class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def check_window_fields(cls, config) -> None:
        pass  # HF's Qwen attention follows layer_types and sliding_window per layer, as ArchConfig does

    @classmethod
    def arch_fields(cls, config) -> dict:
        return dict(attention_bias=True, max_window_layers=getattr(config, "max_window_layers", None))
