"""Gemma 3 (text, ``Gemma3ForCausalLM``): Gemma 2's layer with a `1 + w` RMSNorm on each query and
key head before rotary, no attention soft cap, and a rotary table per layer type: local (sliding)
layers use ``rope_parameters["sliding_attention"]`` (base ``rope_local_base_freq``, 10k), global
ones ``rope_parameters["full_attention"]`` (base 1M, linear scaling 8 in the 4B and larger models).

transformers 5 keeps ``attn_logit_softcapping`` on the config but never applies it, so a value other
than None is refused rather than guessed.
"""
from __future__ import annotations

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .arch import FULL_ATTENTION, SLIDING_ATTENTION
from .decoder import refuse_if
from .gemma import GemmaModelBase, gemma_norm, minus_one_on_norms
from .gemma2 import GEMMA2_GGUF_NORMS, Gemma2DecoderLayer, gguf_query_pre_attn_scalar
from .registry import register_model
from .rotary import rope_frequencies

# What llama.cpp assumes when a Gemma 3 GGUF file does not say: every 6th layer global, local base 10k.
_GGUF_SLIDING_WINDOW_PATTERN = 6
_GGUF_LOCAL_ROPE_BASE = 10000.0


def _gguf_layer_types(metadata) -> list[str]:
    """``attention.sliding_window_pattern``: a period (every n-th layer global) or one flag per
    layer (True: sliding)."""
    num_layers = metadata.model_value("block_count")
    pattern = metadata.model_value("attention.sliding_window_pattern", _GGUF_SLIDING_WINDOW_PATTERN)
    is_sliding = list(pattern) if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(num_layers)]
    if len(is_sliding) != num_layers:
        raise ValueError(f"{metadata.path}: attention.sliding_window_pattern has {len(is_sliding)} entries for "
                         f"{num_layers} layers")
    return [SLIDING_ATTENTION if sliding else FULL_ATTENTION for sliding in is_sliding]


def _gemma3_gguf_fields(metadata) -> dict:
    return dict(sliding_window=metadata.model_value("attention.sliding_window"),
                rope_local_base_freq=metadata.model_value("rope.freq_base_swa", _GGUF_LOCAL_ROPE_BASE),
                layer_types=_gguf_layer_types(metadata),
                final_logit_softcapping=metadata.model_value("final_logit_softcapping", None),
                query_pre_attn_scalar=gguf_query_pre_attn_scalar(metadata, num_layers_of_27b=62))


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    def __init__(self, arch, layer_index: int, rotary, prefix: str = "") -> None:
        super().__init__(arch, layer_index, rotary, prefix, q_norm=gemma_norm(arch.head_dim, arch.rms_norm_eps),
                         k_norm=gemma_norm(arch.head_dim, arch.rms_norm_eps))


@register_model("Gemma3ForCausalLM", model_types=("gemma3_text",), gguf={"gemma3": GGUFArchitecture(
    config_class="Gemma3TextConfig", tensor_names=GEMMA2_GGUF_NORMS, config_fields=_gemma3_gguf_fields,
    transform_tensor=minus_one_on_norms)})
class Gemma3ForCausalLM(GemmaModelBase):
    layer_class = Gemma3DecoderLayer

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        refuse_if(config, "attn_logit_softcapping", lambda cap: cap is not None, cls)

    @classmethod
    def arch_fields(cls, config) -> dict:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope_by_layer_type = {kind: rope_frequencies(config, head_dim, kind)
                              for kind in (SLIDING_ATTENTION, FULL_ATTENTION)}
        return dict(super().arch_fields(config), attention_scale=config.query_pre_attn_scalar**-0.5,
                    final_logit_softcap=config.final_logit_softcapping, rope_by_layer_type=rope_by_layer_type)
