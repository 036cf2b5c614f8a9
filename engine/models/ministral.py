"""Ministral (8B): Mistral whose ``layer_types`` say which layers attend through the sliding
window (HF builds it on Qwen2's layer without the q/k/v biases)."""
from __future__ import annotations

from .decoder import DecoderModel
from .registry import register_model


@register_model("MinistralForCausalLM", model_types=("ministral",))
class MinistralForCausalLM(DecoderModel):
    @classmethod
    def arch_fields(cls, config) -> dict:
        # No bias anywhere; ArchConfig reads layer_types and sliding_window.
        return dict(attention_bias=False)
