"""Plain torch: RMSNorm and LayerNorm of ``x + residual``, returning the sum for the next residual."""
from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual``; returns ``(normed, x + residual)`` so the sum feeds the next residual."""
    if residual is not None:
        x = x + residual
    hidden = x.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of ``x + residual`` over the last dimension; returns ``(normed, x + residual)``.

    All of it in float32, weight and bias included, rounded once to the dtype of the sum (as
    ``nn.LayerNorm`` and HF's ``CohereLayerNorm`` do). ``bias`` may be None (Cohere has none).
    """
    if residual is not None:
        x = x + residual
    hidden = x.float()
    mean = hidden.mean(-1, keepdim=True)
    centered = hidden - mean
    normed = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if bias is not None:
        normed = normed + bias.float()
    return normed.to(x.dtype), x
