"""The plain-torch batched LoRA every other implementation is tested against; the CPU path.

Shrink against every slot at once (one matmul ``[T, K] @ [K, S*R]``), zero each token's columns
of the slots that are not its own, expand with one matmul ``[T, S*R] @ [S*R, N]``. The zeros add
exactly nothing, so a token's result is its own adapter's; the price is ``S`` times the
(small, rank-sized) LoRA FLOPs, which is why callers pass only the slots a step uses.
"""
from __future__ import annotations

import torch


def add_lora(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
             lora_b: torch.Tensor) -> torch.Tensor:
    """``y[t] += (x[t] @ lora_a[s].T) @ lora_b[s]`` for ``s = token_slots[t] >= 0``; returns ``y``.

    >>> y = torch.zeros(2, 3)
    >>> add_lora(y, torch.ones(2, 2), torch.tensor([-1, 0]), torch.ones(1, 1, 2), torch.ones(1, 1, 3))
    tensor([[0., 0., 0.],
            [2., 2., 2.]])
    """
    num_slots, rank, in_features = lora_a.shape
    num_tokens = x.shape[0]
    shrunk = (x @ lora_a.reshape(num_slots * rank, in_features).T).view(num_tokens, num_slots, rank)
    is_own_slot = token_slots.view(-1, 1) == torch.arange(num_slots, device=token_slots.device)
    shrunk = shrunk * is_own_slot.unsqueeze(-1).to(shrunk.dtype)
    y += shrunk.reshape(num_tokens, num_slots * rank) @ lora_b.reshape(num_slots * rank, lora_b.shape[-1])
    return y


def add_lora_per_token(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
                       lora_b: torch.Tensor) -> torch.Tensor:
    """The same by gathering each token's own matrices (``[T, R, K]``): the definition, spelled
    out for tests; too much memory for long prefills."""
    has_adapter = token_slots >= 0
    slots = token_slots.clamp(min=0)
    shrunk = torch.bmm(lora_a[slots], x.unsqueeze(-1)).squeeze(-1)          # [T, R]
    delta = torch.bmm(shrunk.unsqueeze(1), lora_b[slots]).squeeze(1)         # [T, N]
    y += delta * has_adapter.unsqueeze(-1).to(delta.dtype)
    return y


def expand(y: torch.Tensor, shrunk: torch.Tensor, token_slots: torch.Tensor, lora_b: torch.Tensor,
           slot_stride: int = 0) -> torch.Tensor:
    """``y[t] += shrunk[t, s * slot_stride:][:R] @ lora_b[s]`` for ``s = token_slots[t] >= 0`` (the
    expand half alone; ``slot_stride`` as in ``triton_lora.expand_planned``); returns ``y``."""
    rank = lora_b.shape[1]
    rows = torch.nonzero(token_slots >= 0).flatten()
    if len(rows) == 0:
        return y
    slots = token_slots[rows].long()
    if slot_stride:  # shrunk's row holds every slot's ranks: gather each token's own
        columns = slots[:, None] * slot_stride + torch.arange(rank, device=slots.device)
        full = torch.as_strided(shrunk, (shrunk.shape[0], int(columns.max()) + 1), shrunk.stride())
        own = full[rows[:, None], columns]
    else:
        own = shrunk[rows, :rank]
    delta = torch.bmm(own.unsqueeze(1).to(lora_b.dtype), lora_b[slots]).squeeze(1)
    y[rows] += delta.to(y.dtype)
    return y


def token_slots_of(plan, num_tokens: int) -> torch.Tensor:
    """Each token's slot (``-1``: base) from a :class:`~.plan.LoRAPlan`, for the reference path."""
    slots = torch.full((num_tokens,), -1, dtype=torch.long, device=plan.tiles.device)
    if not plan.has_adapters:
        return slots
    tiles = plan.tiles.long()
    tiles = tiles[tiles[:, 0] >= 0]
    offsets = torch.arange(int(tiles[:, 2].max()), device=tiles.device)
    is_token = offsets[None, :] < tiles[:, 2:3]
    positions = (tiles[:, 1:2] + offsets[None, :])[is_token]
    slots[plan.sorted_tokens[positions].long()] = tiles[:, 0:1].expand_as(is_token)[is_token]
    return slots
