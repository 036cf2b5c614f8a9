"""The architecture facts our model code needs, read once from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


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
    attention_bias: bool = False
    has_qk_norm: bool = False
    sliding_window: int | None = None
    max_window_layers: int | None = None

    def sliding_window_for(self, layer_index: int) -> int | None:
        """Qwen2 applies its window only from ``max_window_layers`` on; Mistral applies it everywhere."""
        if self.sliding_window is None:
            return None
        if self.max_window_layers is not None and layer_index < self.max_window_layers:
            return None
        return self.sliding_window

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
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_inv_freq=inv_freq,
            rope_attention_scaling=attention_scaling,
            attention_bias=bool(getattr(config, "attention_bias", False)),
        )
        if getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None):
            fields["sliding_window"] = config.sliding_window
        fields.update(overrides)
        return cls(**fields)


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
    eps = getattr(config, "rms_norm_eps", None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"config.json: rms_norm_eps must be a number in (0, 1), got {eps!r}")


def rope_parameters(config: PretrainedConfig) -> dict:
    """The rotary settings in one shape, whether the config is transformers 5 style
    (``rope_parameters``) or older (``rope_theta`` plus ``rope_scaling``)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
        params.update(getattr(config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling; scaled variants use transformers' own formulas."""
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)
