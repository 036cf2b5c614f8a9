"""Triton batched LoRA, in punica's two shapes, both reading each token's slot on the device.

* **BGMV** (decode-sized steps, ``T <= PER_TOKEN_MAX_TOKENS``): one program per (token, tile);
  no sort, nothing on the host, so it is what CUDA graphs of decode steps capture.
* **SGMV** (prefill-sized steps): tokens sorted by slot (a stable ``argsort`` on the device), one
  program per block of ``BLOCK_M`` sorted tokens, a ``tl.dot`` per distinct slot in the block
  (almost always one: a request's tokens are consecutive and share its adapter).

Shrink writes ``x @ A[slot].T`` in float32 to a ``[T, R]`` scratch; expand adds
``scratch @ B[slot]`` into ``y``. Base-model tokens (slot ``-1``) load and store nothing, so
their rows stay bit-identical to the base projection. Masks for them are bounds or per-row
blocks, never a scalar bool (the interpreter cannot combine those with blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import next_power_of_2

PER_TOKEN_MAX_TOKENS = 128
_NO_SLOT = tl.constexpr(2**30)  # above every slot: "no more slots in this block"


@triton.jit(do_not_specialize=["T"])
def _bgmv_shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, T, K, R, stride_xt, stride_as, stride_ar, stride_ot,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    k_bound = tl.where(slot >= 0, K, 0)  # a base token reads nothing
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


@triton.jit(do_not_specialize=["T"])
def _bgmv_expand_kernel(s_ptr, b_ptr, slots_ptr, y_ptr, T, N, R, stride_st, stride_bs, stride_br, stride_yt,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    n_bound = tl.where(slot >= 0, N, 0)  # a base token loads and stores nothing
    slot = tl.maximum(slot, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r_start in range(0, R, BLOCK_R):  # rank chunks: fused qkv of rank 512 has 1536
        ranks = r_start + tl.arange(0, BLOCK_R)
        s = tl.load(s_ptr + token * stride_st + ranks, mask=ranks < R, other=0.0)
        b_mask = (ranks[:, None] < R) & (cols[None, :] < n_bound)
        b = tl.load(b_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :], mask=b_mask, other=0.0)
        delta += tl.sum(b.to(tl.float32) * s[:, None], axis=0)
    out_mask = cols < n_bound
    y = tl.load(y_ptr + token * stride_yt + cols, mask=out_mask, other=0.0)
    tl.store(y_ptr + token * stride_yt + cols, (y.to(tl.float32) + delta).to(y.dtype), mask=out_mask)


@triton.jit
def _block_tokens(order_ptr, slots_ptr, T, BLOCK_M: tl.constexpr):
    """This program's sorted tokens: their indices, slots, which are real, the first slot."""
    offsets = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    is_token = offsets < T
    tokens = tl.load(order_ptr + offsets, mask=is_token, other=0)
    slots = tl.load(slots_ptr + tokens, mask=is_token, other=-1)
    first = tl.min(tl.where(slots >= 0, slots, _NO_SLOT))
    return tokens, slots, is_token, first


@triton.jit(do_not_specialize=["T"])
def _sgmv_shrink_kernel(x_ptr, a_ptr, slots_ptr, order_ptr, out_ptr, T, K, R, stride_xt, stride_as, stride_ar,
                        stride_ot, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_IN_FP32: tl.constexpr):
    tokens, slots, is_token, slot = _block_tokens(order_ptr, slots_ptr, T, BLOCK_M)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    is_rank = ranks < R
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    while slot < _NO_SLOT:  # each distinct slot of the block, in order
        is_row = slots == slot
        for k_start in range(0, K, BLOCK_K):
            is_k = ks < K - k_start
            x = tl.load(x_ptr + tokens[:, None] * stride_xt + (k_start + ks)[None, :],
                        mask=is_row[:, None] & is_k[None, :], other=0.0)
            a = tl.load(a_ptr + slot * stride_as + ranks[None, :] * stride_ar + (k_start + ks)[:, None],
                        mask=is_rank[None, :] & is_k[:, None], other=0.0)
            if DOT_IN_FP32:
                acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, a, acc)
        slot = tl.min(tl.where(slots > slot, slots, _NO_SLOT))
    tl.store(out_ptr + tokens[:, None] * stride_ot + ranks[None, :], acc, mask=is_token[:, None] & is_rank[None, :])


@triton.jit(do_not_specialize=["T"])
def _sgmv_expand_kernel(s_ptr, b_ptr, slots_ptr, order_ptr, y_ptr, T, N, R, stride_st, stride_bs, stride_br,
                        stride_yt, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_IN_FP32: tl.constexpr):
    tokens, slots, is_token, slot = _block_tokens(order_ptr, slots_ptr, T, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < N
    rs = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    while slot < _NO_SLOT:
        is_row = slots == slot
        for r_start in range(0, R, BLOCK_R):
            is_rank = rs < R - r_start
            s = tl.load(s_ptr + tokens[:, None] * stride_st + (r_start + rs)[None, :],
                        mask=is_row[:, None] & is_rank[None, :], other=0.0)
            b = tl.load(b_ptr + slot * stride_bs + (r_start + rs)[:, None] * stride_br + cols[None, :],
                        mask=is_rank[:, None] & is_col[None, :], other=0.0)
            if DOT_IN_FP32:
                acc = tl.dot(s, b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(s.to(b.dtype), b, acc)
        slot = tl.min(tl.where(slots > slot, slots, _NO_SLOT))
    out_mask = (slots >= 0)[:, None] & is_col[None, :]
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + cols[None, :]
    y = tl.load(y_ptrs, mask=out_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=out_mask)


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
    if num_tokens <= PER_TOKEN_MAX_TOKENS:
        _bgmv(y, x, token_slots, lora_a, lora_b, shrunk)
    else:
        _sgmv(y, x, token_slots, lora_a, lora_b, shrunk)
    return y


def _bgmv(y, x, token_slots, lora_a, lora_b, shrunk) -> None:
    (num_tokens, in_features), (_, rank, out_features) = x.shape, lora_b.shape
    block_r = min(next_power_of_2(rank), 64)
    _bgmv_shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x, lora_a, token_slots, shrunk, num_tokens, in_features, rank, x.stride(0), lora_a.stride(0),
        lora_a.stride(1), shrunk.stride(0), BLOCK_R=block_r, BLOCK_K=128)
    _bgmv_expand_kernel[(num_tokens, triton.cdiv(out_features, 64))](
        shrunk, lora_b, token_slots, y, num_tokens, out_features, rank, shrunk.stride(0), lora_b.stride(0),
        lora_b.stride(1), y.stride(0), BLOCK_R=min(next_power_of_2(rank), 64), BLOCK_N=64)


def _sgmv(y, x, token_slots, lora_a, lora_b, shrunk) -> None:
    (num_tokens, in_features), (_, rank, out_features) = x.shape, lora_b.shape
    order = torch.argsort(token_slots, stable=True)
    dot_in_fp32 = x.dtype == torch.float32
    block_m, block_r, block_n = 64, min(max(16, next_power_of_2(rank)), 64), 64
    num_blocks = triton.cdiv(num_tokens, block_m)
    _sgmv_shrink_kernel[(num_blocks, triton.cdiv(rank, block_r))](
        x, lora_a, token_slots, order, shrunk, num_tokens, in_features, rank, x.stride(0), lora_a.stride(0),
        lora_a.stride(1), shrunk.stride(0), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=32 if dot_in_fp32 else 64,
        DOT_IN_FP32=dot_in_fp32)
    _sgmv_expand_kernel[(num_blocks, triton.cdiv(out_features, block_n))](
        shrunk, lora_b, token_slots, order, y, num_tokens, out_features, rank, shrunk.stride(0), lora_b.stride(0),
        lora_b.stride(1), y.stride(0), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n,
        DOT_IN_FP32=dot_in_fp32)
