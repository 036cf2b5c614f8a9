"""Gemma: Llama with `1 + w` RMSNorms, the token embedding scaled by ``sqrt(hidden_size)``, a GeGLU
feed-forward (tanh GELU under ``hidden_act``) and, as released, a head tied to the embedding.

Gemma 2 and 3 (:mod:`.gemma2`, :mod:`.gemma3`) build on the pieces here.

In bf16 HF rounds the embedding scale to bf16 first (``sqrt(3072)`` becomes 55.5), and we do too;
HF's norms multiply by ``1 + w`` in float32 before rounding, ours hold ``1 + w`` rounded to the
model dtype (one more rounding; fp32 is exact).

>>> llm = LLM("google/gemma-2b-it")
"""
from __future__ import annotations

import torch

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .decoder import DecoderLayer, DecoderModel, refuse_if
from .norms import RMSNorm
from .registry import register_model


def gemma_norm(size: int, eps: float) -> RMSNorm:
    """Gemma's RMSNorm: the checkpoint holds ``w``, the math uses ``1 + w``."""
    return RMSNorm(size, eps, weight_offset=1.0)


def minus_one_on_norms(hf_name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """llama.cpp's converter stores Gemma's norm weights as ``1 + w``; HF checkpoints hold ``w``."""
    return tensor - 1 if hf_name.endswith("norm.weight") else tensor


class GemmaDecoderLayer(DecoderLayer):
    """Llama's layer with `1 + w` norms."""

    def __init__(self, arch, layer_index: int, rotary, prefix: str = "") -> None:
        super().__init__(arch, layer_index, rotary, prefix)
        self.input_layernorm = gemma_norm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = gemma_norm(arch.hidden_size, arch.rms_norm_eps)


class GemmaModelBase(DecoderModel):
    """What Gemma 1, 2 and 3 share: the scaled embedding and `1 + w` norms."""

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        refuse_if(config, "use_bidirectional_attention", bool, cls)

    @classmethod
    def arch_fields(cls, config) -> dict:
        return dict(embedding_multiplier=config.hidden_size**0.5,
                    o_proj_bias=bool(getattr(config, "attention_bias", False)))

    def __init__(self, arch) -> None:
        super().__init__(arch)
        self.embed_scale = arch.embedding_multiplier

    def make_norm(self) -> RMSNorm:
        return gemma_norm(self.arch.hidden_size, self.arch.rms_norm_eps)

    def materialize_buffers(self, dtype: torch.dtype) -> None:
        super().materialize_buffers(dtype)
        # HF multiplies by the scale as a tensor of the model dtype: rounded to it first.
        self.embed_scale = torch.tensor(self.arch.embedding_multiplier, dtype=dtype).item()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


@register_model("GemmaForCausalLM", model_types=("gemma",), gguf={"gemma": GGUFArchitecture(
    config_class="GemmaConfig", transform_tensor=minus_one_on_norms)})
class GemmaForCausalLM(GemmaModelBase):
    layer_class = GemmaDecoderLayer

    @classmethod
    def arch_fields(cls, config) -> dict:
        # GemmaConfig itself reads a legacy hidden_act="gelu" as the tanh GELU Gemma was trained with.
        fields = super().arch_fields(config)
        if getattr(config, "hidden_act", None) == "gelu":
            fields["hidden_act"] = "gelu_pytorch_tanh"
        return fields
