"""Qwen2 / Qwen2.5: Llama with biases on q, k and v, and a window only on the upper layers."""
from __future__ import annotations

from .arch import ArchConfig
from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_from_hf_config(cls, config) -> ArchConfig:
        return ArchConfig.from_hf_config(
            config, attention_bias=True, max_window_layers=getattr(config, "max_window_layers", None)
        )
