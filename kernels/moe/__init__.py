"""Mixture-of-experts kernels, with their own dispatch point: Triton on CUDA tensors, the
sort-by-expert CPU path on CPU tensors, the torch reference for anything else.

Experts are stacked: ``w13`` ``[E, 2 I, H]`` (gate rows, then up rows) and ``w2`` ``[E, H, I]``.

>>> from hearth_llm.kernels.moe import fused_moe, select_experts
>>> hidden = torch.randn(5, 16)
>>> weights, ids = select_experts(torch.randn(5, 4), top_k=2, renormalize=True)
>>> fused_moe(hidden, torch.randn(4, 2 * 8, 16), torch.randn(4, 16, 8), weights, ids).shape
torch.Size([5, 16])
"""
from __future__ import annotations

import torch

from ..lazy_triton import triton_module
from . import cpu, reference

__all__ = ["fused_moe", "select_experts"]


def _triton_module():
    """The Triton implementation, or None where Triton is unavailable."""
    return triton_module(__name__)


def _implementation(name: str, tensor: torch.Tensor):
    if tensor.is_cuda and _triton_module() is not None:
        return getattr(_triton_module(), name)
    if tensor.device.type == "cpu" and hasattr(cpu, name):
        return getattr(cpu, name)
    return getattr(reference, name)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts from its router logits ``[T, E]``: softmax (float32), top-k,
    and with ``renormalize`` the kept probabilities rescaled to sum to 1. Returns float32 weights and
    integer ids, both ``[T, top_k]``."""
    return _implementation("select_experts", router_logits)(router_logits, top_k, renormalize)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted output ``[T, H]`` for ``hidden`` ``[T, H]``, SiLU-gated (see the module doc)."""
    return _implementation("fused_moe", hidden)(hidden, w13, w2, topk_weights, topk_ids)
