"""Rotary position embedding: the frequencies a config asks for, and the layer that applies them.

Partial rotary (only the first ``rotary_dim`` of each head's dimensions rotate) is a narrower
``cos_sin_cache``: the kernels rotate as many dimensions as the table is wide. GPT-J style
(adjacent pairs instead of halves) is ``is_neox_style=False``. A model whose layer types use
different bases (Gemma 3: local and global) builds one :class:`RotaryEmbedding` per type.

>>> inv_freq, scaling = rope_frequencies(config, head_dim=64)
>>> rotary = RotaryEmbedding(inv_freq, max_position=4096, attention_scaling=scaling)
>>> query, key = rotary(positions, query, key)
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from hearth_llm import kernels

# Rope types whose HF implementation changes the frequencies at run time with the sequence length
# (longrope switches short/long factors, dynamic NTK rescales): a fixed table is only right while
# sequences stay within the original context, so model classes refuse them unless they opt in.
RUNTIME_ROPE_TYPES = frozenset({"dynamic", "longrope"})


class RotaryEmbedding(nn.Module):
    """Rotates queries and keys by position through ``kernels.rotary_embedding``.

    ``cos_sin_cache`` is ``[max_position, rotary_dim]`` (cosines then sines), in the model's dtype;
    the frequencies are kept on the host so the table can be rebuilt after building on ``meta``.
    """

    def __init__(self, inv_freq: torch.Tensor, max_position: int, attention_scaling: float = 1.0,
                 is_neox_style: bool = True) -> None:
        super().__init__()
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.max_position = max_position
        self.attention_scaling = attention_scaling
        self.is_neox_style = is_neox_style
        self.register_buffer("cos_sin_cache", self._table(), persistent=False)

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def _table(self) -> torch.Tensor:
        if torch.get_default_device().type == "meta":
            # Shapes only (the model built on meta). arange on meta goes through torch's Python
            # decompositions, whose first use imports torch._dynamo: ~1-2 s of every cold start.
            return torch.empty(self.max_position, self.rotary_dim)
        positions = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.to(positions.device))
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Recompute the table on ``device`` (after ``to_empty`` left it uninitialised)."""
        with torch.device("cpu"):
            self.cos_sin_cache = self._table().to(device=device, dtype=dtype)

    def forward(self, positions, query, key):
        return kernels.rotary_embedding(query, key, positions, self.cos_sin_cache, self.is_neox_style)


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The rotary settings in one shape, whether the config is transformers 5 style
    (``rope_parameters``, possibly one dict per layer type) or older (``rope_theta`` plus
    ``rope_scaling``)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
        params.update(getattr(config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    return params


def is_per_layer_type(config: PretrainedConfig) -> bool:
    """Whether ``config.rope_parameters`` holds one dict per layer type (Gemma 3 style)."""
    params = getattr(config, "rope_parameters", None) or {}
    return bool(params) and all(isinstance(value, dict) for value in params.values())


def rope_frequencies(config: PretrainedConfig, head_dim: int, layer_type: str | None = None
                     ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling; scaled variants use transformers' own formulas.

    The frequencies cover ``head_dim * partial_rotary_factor`` dimensions.
    """
    params = rope_parameters(config, layer_type)
    if params["rope_type"] == "default":
        rotary_dim = int(head_dim * params["partial_rotary_factor"])
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    kwargs = {"layer_type": layer_type} if layer_type is not None and is_per_layer_type(config) else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)
