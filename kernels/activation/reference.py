"""Plain torch: the MLP activations (SwiGLU, GeGLU, GELU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a merged gate/up projection: ``silu(x[..., :I]) * x[..., I:]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


GELU_APPROXIMATIONS = ("tanh", "none")


def check_gelu_approximate(approximate: str) -> None:
    """ValueError unless ``approximate`` names a GELU of ``F.gelu``."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU activation of a merged gate/up projection: ``gelu(x[..., :I]) * x[..., I:]``.

    ``approximate="tanh"`` is HF's ``gelu_pytorch_tanh`` (Gemma), ``"none"`` the exact erf GELU.
    """
    check_gelu_approximate(approximate)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def gelu(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU of a non-gated MLP's up projection (StarCoder2)."""
    check_gelu_approximate(approximate)
    return F.gelu(x, approximate=approximate)
