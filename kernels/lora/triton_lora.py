"""Triton batched LoRA (punica's BGMV shape): one program per (token, tile), reading its slot.

Shrink writes ``x @ A[slot].T`` in float32 to a ``[T, R]`` scratch; expand adds
``scratch @ B[slot]`` into ``y`` where the token has a slot. Base-model tokens (slot ``-1``)
load nothing (every load is masked by it) and store nothing, so their rows stay bit-identical to
the base projection. The slot is read on the device, so the launch needs no host sync and is
captured into CUDA graphs as is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import next_power_of_2


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, K, R, stride_xt, stride_as, stride_ar, stride_ot,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    # A base token (slot -1) reads nothing: its bound is 0 (a bound, not a scalar mask, which
    # the interpreter cannot combine with a block).
    k_bound = tl.where(slot >= 0, K, 0)
    slot = tl.maximum(slot, 0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        cols = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_xt + cols, mask=cols < k_bound, other=0.0).to(tl.float32)
        a_mask = (rows[:, None] < R) & (cols[None, :] < k_bound)
        a = tl.load(a_ptr + slot * stride_as + rows[:, None] * stride_ar + cols[None, :], mask=a_mask, other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + token * stride_ot + rows, acc, mask=rows < R)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, slots_ptr, y_ptr, N, R, stride_st, stride_bs, stride_br, stride_yt,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    n_bound = tl.where(slot >= 0, N, 0)  # a base token loads and stores nothing
    slot = tl.maximum(slot, 0)
    ranks = tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(s_ptr + token * stride_st + ranks, mask=ranks < R, other=0.0)
    b_mask = (ranks[:, None] < R) & (cols[None, :] < n_bound)
    b = tl.load(b_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :], mask=b_mask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * s[:, None], axis=0)
    out_mask = cols < n_bound
    y = tl.load(y_ptr + token * stride_yt + cols, mask=out_mask, other=0.0)
    tl.store(y_ptr + token * stride_yt + cols, (y.to(tl.float32) + delta).to(y.dtype), mask=out_mask)


def add_lora(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
             lora_b: torch.Tensor) -> torch.Tensor:
    """See :func:`hearth_llm.kernels.lora.add_lora`; ``y`` must have unit stride along its rows."""
    num_tokens, in_features = x.shape
    _, rank, out_features = lora_b.shape
    if num_tokens == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    shrunk = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    block_r = min(next_power_of_2(rank), 64)
    _shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x, lora_a, token_slots, shrunk, in_features, rank, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        shrunk.stride(0), BLOCK_R=block_r, BLOCK_K=128)
    block_n = 64
    _expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        shrunk, lora_b, token_slots, y, out_features, rank, shrunk.stride(0), lora_b.stride(0), lora_b.stride(1),
        y.stride(0), BLOCK_R=next_power_of_2(rank), BLOCK_N=block_n)
    return y
