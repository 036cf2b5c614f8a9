"""SmolLM3: Llama where the layers ``no_rope_layers`` marks 0 use no rotary at all (NoPE), and,
with ``use_sliding_window``, a window on the layers ``layer_types`` marks ``sliding_attention``.

llama.cpp converts SmolLM3 as Llama (q/k rows permuted) and hard-codes NoPE on every 4th layer
(no GGUF key says so), which is also HF's default ``no_rope_layer_interval``.

A NoPE layer gets a rotary table of zero frequencies: cos 1, sin 0, so the rotation returns its
input exactly and the shared attention path (one fused kernel on CUDA) needs no special case.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .arch import ArchConfig
from .decoder import DecoderModel
from .registry import register_model
from .rotary import RotaryEmbedding


@dataclass(slots=True)
class SmolLM3Arch(ArchConfig):
    rope_layers: tuple[bool, ...] = ()


_SMOLLM3_GGUF = GGUFArchitecture(config_class="SmolLM3Config", permuted_qk=True,
                                 config_fields=lambda metadata: {"no_rope_layer_interval": 4})


@register_model("SmolLM3ForCausalLM", model_types=("smollm3",), gguf={"smollm3": _SMOLLM3_GGUF})
class SmolLM3ForCausalLM(DecoderModel):
    arch_class = SmolLM3Arch

    @classmethod
    def arch_fields(cls, config) -> dict:
        no_rope_layers = list(config.no_rope_layers)
        if len(no_rope_layers) != config.num_hidden_layers or not set(no_rope_layers) <= {0, 1}:
            raise ValueError(f"config.json: no_rope_layers={no_rope_layers!r:.120} must hold 0 or 1 for each of the "
                             f"{config.num_hidden_layers} layers")
        return dict(rope_layers=tuple(map(bool, no_rope_layers)), o_proj_bias=bool(config.attention_bias),
                    mlp_bias=bool(config.mlp_bias))

    def make_layer(self, layer_index: int, rotary: RotaryEmbedding):
        if not self.arch.rope_layers[layer_index]:
            rotary = RotaryEmbedding(torch.zeros_like(rotary.inv_freq), self.arch.max_position_embeddings)
        return super().make_layer(layer_index, rotary)
