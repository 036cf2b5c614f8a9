"""Qwen3: Llama with RMSNorm on each head's queries and keys before rotary."""
from __future__ import annotations

from .arch import ArchConfig
from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_from_hf_config(cls, config) -> ArchConfig:
        return ArchConfig.from_hf_config(
            config, has_qk_norm=True, max_window_layers=getattr(config, "max_window_layers", None)
        )
