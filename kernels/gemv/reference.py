"""Plain torch: what the fused small-row matmuls of ``triton_gemv.py`` compute, as the unfused
ops compute it (each intermediate rounded to the activation dtype where the unfused kernels store it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(x + residual) @ weight.T, x + residual)``; with no residual the second is ``x``.

    >>> out, summed = rms_norm_linear(torch.ones(1, 4), None, torch.ones(4), 1e-6, torch.ones(3, 4))
    >>> out.tolist(), summed is not None
    ([[4.0, 4.0, 4.0]], True)
    """
    summed = x if residual is None else x + residual
    hidden = summed.float()
    normed = (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)).to(summed.dtype)
    return F.linear(norm_weight * normed, weight), summed


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(silu(x[:, :I]) * x[:, I:]) @ weight.T`` with ``I = weight.shape[1]``, the product rounded
    to x's dtype first (as ``kernels.silu_and_mul`` stores it).

    >>> silu_and_mul_linear(torch.zeros(1, 8), torch.ones(2, 4)).tolist()
    [[0.0, 0.0]]
    """
    intermediate = weight.shape[1]
    gate, up = x[..., :intermediate].float(), x[..., intermediate:].float()
    return F.linear((F.silu(gate) * up).to(x.dtype), weight)


def rms_norm_linear_silu_and_mul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                                 eps: float, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu(g) * u, x + residual)`` where ``[g, u] = RMSNorm(x + residual) @ weight.T`` (weight
    ``[2 * I, K]``, gate rows first), the matmul's output rounded to x's dtype before SwiGLU.

    >>> act, _ = rms_norm_linear_silu_and_mul(torch.ones(1, 4), None, torch.ones(4), 1e-6, torch.zeros(6, 4))
    >>> act.tolist()
    [[0.0, 0.0, 0.0]]
    """
    gate_up, summed = rms_norm_linear(x, residual, norm_weight, eps, weight)
    intermediate = weight.shape[0] // 2
    gate, up = gate_up[..., :intermediate].float(), gate_up[..., intermediate:].float()
    return (F.silu(gate) * up).to(x.dtype), summed


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T``."""
    return F.linear(x, weight)
