"""Activations by their Hugging Face ``hidden_act`` names (``transformers.activations.ACT2FN``).

:func:`gated_activation` is what a gated MLP applies to its fused ``[gate | up]`` projection
(``act(gate) * up``), :func:`activation` the plain one. Names HF allows but we do not implement
raise ``ValueError`` naming the value, so a config never runs a different function than HF's.

>>> gated_activation("gelu_pytorch_tanh")(torch.randn(3, 8)).shape
torch.Size([3, 4])
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hearth_llm import kernels

# The tanh approximation of GELU under its HF names (all the same formula, written differently).
_TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh", "gelu_accurate")
_EXACT_GELUS = ("gelu", "gelu_python")

# Activations without a kernel of their own: plain torch, exactly HF's formulas.
_TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "linear": lambda x: x,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu_10": lambda x: torch.clamp(F.gelu(x), -10.0, 10.0),
}

SUPPORTED_ACTIVATIONS = ("silu", "swish", *_TANH_GELUS, *_EXACT_GELUS, *_TORCH_ACTIVATIONS)


def check_activation(name: str, owner: str = "this model") -> None:
    """``ValueError`` naming ``hidden_act`` when ``name`` is not one we run exactly as HF does."""
    _check(name, owner)


def _check(name: str, owner: str) -> None:
    if name not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act={name!r} is not supported by {owner} here; supported: "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)}")


def activation(name: str, owner: str = "this model") -> Callable[[torch.Tensor], torch.Tensor]:
    """``act(x)`` for HF activation ``name``; ``owner`` names the model class in the error."""
    _check(name, owner)
    if name in ("silu", "swish"):
        return F.silu
    if name in _TANH_GELUS:
        return lambda x: kernels.gelu(x, "tanh")
    if name in _EXACT_GELUS:
        return lambda x: kernels.gelu(x, "none")
    return _TORCH_ACTIVATIONS[name]


def gated_activation(name: str, owner: str = "this model") -> Callable[[torch.Tensor], torch.Tensor]:
    """``act(gate) * up`` of a fused ``[..., 2 * I]`` gate/up projection."""
    _check(name, owner)
    if name in ("silu", "swish"):
        return kernels.silu_and_mul
    if name in _TANH_GELUS:
        return lambda x: kernels.gelu_and_mul(x, "tanh")
    if name in _EXACT_GELUS:
        return lambda x: kernels.gelu_and_mul(x, "none")
    act = _TORCH_ACTIVATIONS[name]

    def act_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    return act_and_mul
