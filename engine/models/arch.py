"""The architecture facts our model code needs, read once from a Hugging Face config.

:class:`ArchConfig` holds what every decoder model reads (shapes, norms, rotary, per-layer
attention windows, biases, activation, logit transforms). An architecture with facts of its own
subclasses it in its model file::

    @dataclass(slots=True)
    class Gemma2Arch(ArchConfig):
        query_pre_attn_scalar: float = 256.0

        @classmethod
        def from_hf_config(cls, config, **overrides):
            return super(Gemma2Arch, cls).from_hf_config(
                config, query_pre_attn_scalar=config.query_pre_attn_scalar, **overrides)

Every field that changes the math is either read here or refused by the model class's
``check_config`` (see :mod:`.decoder`), never silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from .rotary import rope_frequencies, rope_parameters

SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"


@dataclass(slots=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_inv_freq: torch.Tensor
    rope_attention_scaling: float = 1.0
    # Per layer type ("sliding_attention" / "full_attention") rotary, where the two differ (Gemma 3).
    rope_by_layer_type: dict[str, tuple[torch.Tensor, float]] | None = None
    is_neox_style: bool = True             # rotate halves (HF); False: GPT-J interleaved pairs
    attention_bias: bool = False           # on q, k and v
    o_proj_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    has_qk_norm: bool = False
    sliding_window: int | None = None
    max_window_layers: int | None = None
    layer_types: tuple[str, ...] | None = None   # explicit per-layer attention kind, as HF's config
    attention_scale: float | None = None   # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    embedding_multiplier: float | None = None
    logits_multiplier: float | None = None
    final_logit_softcap: float | None = None

    def layer_type(self, layer_index: int) -> str:
        """``"sliding_attention"`` or ``"full_attention"`` for a layer."""
        if self.layer_types is not None:
            return self.layer_types[layer_index]
        if self.sliding_window is None:
            return FULL_ATTENTION
        if self.max_window_layers is not None and layer_index < self.max_window_layers:
            return FULL_ATTENTION
        return SLIDING_ATTENTION

    def sliding_window_for(self, layer_index: int) -> int | None:
        """The window of a sliding layer; Qwen2 applies it only from ``max_window_layers`` on,
        Mistral everywhere, configs with ``layer_types`` where those say so."""
        if self.sliding_window is None or self.layer_type(layer_index) != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    def rope_for_layer(self, layer_index: int) -> tuple[torch.Tensor, float]:
        """``(inv_freq, attention_scaling)`` of a layer's rotary."""
        if self.rope_by_layer_type is not None:
            return self.rope_by_layer_type[self.layer_type(layer_index)]
        return self.rope_inv_freq, self.rope_attention_scaling

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig, **overrides) -> "ArchConfig":
        """The facts of ``config``; ``ValueError`` naming the config field when one is unusable."""
        _check_shape_fields(config)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        try:
            inv_freq, attention_scaling = rope_frequencies(config, head_dim)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            raise ValueError(f"config.json: rope settings {rope_parameters(config)!r:.200} are unusable: "
                             f"{error!r}") from error
        fields = dict(
            architecture=(config.architectures or [config.model_type])[0],
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_inv_freq=inv_freq,
            rope_attention_scaling=attention_scaling,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            hidden_act=getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu",
        )
        if getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None):
            fields["sliding_window"] = config.sliding_window
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            fields["layer_types"] = _checked_layer_types(layer_types, config.num_hidden_layers)
        fields.update(overrides)
        return cls(**fields)


def _checked_layer_types(layer_types, num_layers: int) -> tuple[str, ...]:
    known = (SLIDING_ATTENTION, FULL_ATTENTION)
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        raise ValueError(f"config.json: layer_types must list one entry per layer ({num_layers}), got "
                         f"{layer_types!r:.120}")
    unknown = sorted({kind for kind in layer_types if kind not in known})
    if unknown:
        raise ValueError(f"config.json: layer_types entries {unknown} are not supported; known: {list(known)}")
    return tuple(layer_types)


_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "max_position_embeddings")


def _check_shape_fields(config: PretrainedConfig) -> None:
    def is_positive_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    for name in _POSITIVE_INT_FIELDS:
        if not is_positive_int(getattr(config, name, None)):
            raise ValueError(f"config.json: {name} must be a positive integer, got {getattr(config, name, None)!r}")
    for name in ("num_key_value_heads", "head_dim"):
        value = getattr(config, name, None)
        if value is not None and not is_positive_int(value):
            raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if config.num_attention_heads % num_kv_heads:
        raise ValueError(f"config.json: num_attention_heads={config.num_attention_heads} must be a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    if getattr(config, "head_dim", None) is None and config.hidden_size % config.num_attention_heads:
        raise ValueError(f"config.json: hidden_size={config.hidden_size} must be a multiple of "
                         f"num_attention_heads={config.num_attention_heads} when head_dim is not given")
    eps_name = "rms_norm_eps" if hasattr(config, "rms_norm_eps") or not hasattr(config, "layer_norm_eps") \
        else "layer_norm_eps"
    eps = getattr(config, eps_name, None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"config.json: {eps_name} must be a number in (0, 1), got {eps!r}")
