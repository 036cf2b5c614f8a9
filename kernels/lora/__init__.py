"""Batched LoRA: every token of a step adds the low-rank update of its own adapter, in one call.

Adapters sit in slots: ``lora_a`` ``[S, R, K]`` (the down projections) and ``lora_b``
``[S, R, N]`` (the up projections, transposed, with the adapter's scale folded in); a token's
slot is ``token_slots[t]``, ``-1`` for the base model. :func:`add_lora` computes, in place,

    ``y[t] += (x[t] @ lora_a[s].T) @ lora_b[s]``  for ``s = token_slots[t] >= 0``

as punica's shrink (x → rank space) and expand (rank space → output) over a per-token slot index,
with no Python loop over tokens or adapters. One dispatch point: Triton on CUDA tensors, the
torch reference (:mod:`.reference`) anywhere else.

The engine plans a step once (:class:`~.plan.LoRAPlan`: tokens grouped by slot, in tiles) and
calls :func:`add_lora_planned` for every layer-projection; :func:`add_lora` plans from a per-token
slot index on each call (tests, one-off use).

>>> from hearth_llm.kernels.lora import add_lora
>>> y = torch.zeros(3, 8)
>>> add_lora(y, torch.randn(3, 4), torch.tensor([0, -1, 1]), torch.randn(2, 2, 4), torch.randn(2, 2, 8))
>>> bool((y[1] == 0).all())
True
"""
from __future__ import annotations

import torch

from ..activation.reference import silu_and_mul
from ..lazy_triton import triton_module
from . import reference
from .plan import LoRAPlan

__all__ = ["LoRAPlan", "add_lora", "add_lora_planned", "expand_planned", "expand_silu_and_mul_planned", "scratch_numel",
           "shrink_planned"]

SCRATCH_MIN_ROWS = 16384  # decode steps split K: up to 32 partial rows per token, plus the sums
SCRATCH_TICKETS = 8192    # = triton_lora.NUM_TICKETS (kept here so the size needs no Triton import)


def _triton_module():
    """The Triton implementation, or None where Triton is unavailable."""
    return triton_module(__name__)


def add_lora(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
             lora_b: torch.Tensor) -> torch.Tensor:
    """Add each token's adapter update to ``y`` ``[T, N]`` in place (see the module doc); returns ``y``."""
    if y.is_cuda and _triton_module() is not None:
        return _triton_module().add_lora(y, x, token_slots, lora_a, lora_b)
    return reference.add_lora(y, x, token_slots, lora_a, lora_b)


def add_lora_planned(y: torch.Tensor, x: torch.Tensor, plan: LoRAPlan, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     slice_starts: torch.Tensor, slice_rank: int, scratch: torch.Tensor) -> torch.Tensor:
    """The same for the tokens and slots of a step's ``plan``, with ``lora_a``/``lora_b`` in
    ``len(slice_starts) - 1`` slices of ``slice_rank`` ranks (a fused layer's q, k, v), in one
    shrink and one expand launch; see :func:`.triton_lora.add_lora_planned` for the arguments."""
    if y.is_cuda and _triton_module() is not None:
        return _triton_module().add_lora_planned(y, x, plan, lora_a, lora_b, slice_starts, slice_rank, scratch)
    return reference.add_lora(y, x, reference.token_slots_of(plan, x.shape[0]), lora_a, lora_b)


def scratch_numel(max_tokens: int, max_ranks: int) -> int:
    """Float32 elements of the zero-filled scratch :func:`add_lora_planned` needs for steps of up to
    ``max_tokens`` tokens and layers of up to ``max_ranks`` ranks (all slices)."""
    return max(max_tokens, SCRATCH_MIN_ROWS) * max_ranks + SCRATCH_TICKETS


def shrink_planned(x: torch.Tensor, plan: LoRAPlan, lora_a: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """CUDA: the shrink half of :func:`add_lora_planned` alone (it reads only ``x``, so a caller may run
    it on another stream beside the base projection); returns the float32 ``[T, R]`` rank-space rows."""
    return _triton_module().shrink_planned(x, plan, lora_a, scratch)


def expand_planned(y: torch.Tensor, shrunk: torch.Tensor, plan: LoRAPlan, lora_b: torch.Tensor,
                   slice_starts: torch.Tensor, slice_rank: int, slot_stride: int = 0) -> torch.Tensor:
    """The expand half, ``y[t] += shrunk[t] @ lora_b[s]`` for the plan's tokens; returns ``y``.
    ``slot_stride``: see :func:`.triton_lora.expand_planned` (shrunk rows of every slot's ranks)."""
    if y.is_cuda and _triton_module() is not None:
        return _triton_module().expand_planned(y, shrunk, plan, lora_b, slice_starts, slice_rank, slot_stride)
    return reference.expand(y, shrunk, reference.token_slots_of(plan, y.shape[0]), lora_b, slot_stride)


def expand_silu_and_mul_planned(y: torch.Tensor, shrunk: torch.Tensor, plan: LoRAPlan, lora_b: torch.Tensor,
                                slice_rank: int, slot_stride: int) -> torch.Tensor:
    """A gated MLP's SwiGLU of its ``gate_up_proj`` output ``y`` with each token's update added on the
    way in (:func:`expand_planned` then the activation, without writing the sum back): returns
    ``silu(g) * u`` ``[T, I]``; see :func:`.triton_lora.expand_silu_and_mul_planned` for the arguments.
    Elsewhere than CUDA: the reference expand (into ``y``, in place) and the reference activation."""
    if y.is_cuda and _triton_module() is not None:
        return _triton_module().expand_silu_and_mul_planned(y, shrunk, plan, lora_b, slice_rank, slot_stride)
    y = reference.expand(y, shrunk, reference.token_slots_of(plan, y.shape[0]), lora_b, slot_stride)
    return silu_and_mul(y)
