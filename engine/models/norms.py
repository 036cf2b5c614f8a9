"""Normalization layers: RMSNorm (optionally with Gemma's ``1 + w`` weight) and LayerNorm.

Each returns the normed tensor, or with ``residual`` given, ``(normed, x + residual)``: the sum
is the next residual stream, computed in the same kernel.

>>> norm = RMSNorm(64, eps=1e-6)
>>> normed, residual = norm(hidden, residual)
"""
from __future__ import annotations

import torch
from torch import nn

from hearth_llm import kernels


def _frozen(tensor: torch.Tensor, weight_loader=None) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=False)
    if weight_loader is not None:
        param.weight_loader = weight_loader
    return param


class RMSNorm(nn.Module):
    """``x / rms(x) * w``; with ``weight_offset=1.0`` it is Gemma's ``x / rms(x) * (1 + w)``.

    The offset is added once, when the checkpoint weight loads (the parameter holds ``w + offset``),
    so the kernel is the same for both.
    """

    def __init__(self, size: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = _frozen(torch.ones(size), self.weight_loader)

    def _apply(self, fn, recurse=True):
        # Moving between devices (to_empty from meta) makes a new Parameter: re-attach the loader.
        module = super()._apply(fn, recurse)
        self.weight.weight_loader = self.weight_loader
        return module

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded_weight.shape) != tuple(param.shape):
            raise ValueError(f"norm weight has shape {tuple(loaded_weight.shape)}, the config makes it "
                             f"{tuple(param.shape)}")
        # Offset in float32 first: 1 + w rounded once, as HF computes it.
        param.data.copy_(loaded_weight.float() + self.weight_offset if self.weight_offset else loaded_weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        normed, summed = kernels.rms_norm(x, self.weight, self.eps, residual)
        return normed if residual is None else (normed, summed)


class LayerNorm(nn.Module):
    """``(x - mean) / std * w (+ b)``; ``bias=False`` for LayerNorms without one (Cohere)."""

    def __init__(self, size: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _frozen(torch.ones(size))
        self.bias = _frozen(torch.zeros(size)) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        normed, summed = kernels.layer_norm(x, self.weight, self.bias, self.eps, residual)
        return normed if residual is None else (normed, summed)
