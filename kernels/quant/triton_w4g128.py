"""Triton: ``x @ W.T + bias`` for ``W4G128`` rows (AWQ/GPTQ 4-bit, groups of 128), reading words.

The generic block decoder of ``gguf_triton.py`` gathers every code byte by byte; this one reads a
group's 68 bytes as 17 int32 words — word 0 holds the float16 scale and the zero point, words
1..16 the codes, byte ``j`` of them element ``j`` (low nibble) and ``j + 64`` (high nibble) — and
splits them with shifts, so each group is two ``[BLOCK_N, 64]`` tiles in registers. Decode-sized
steps take a GEMV; from ``DEQUANT_MIN_ROWS`` rows the weight is dequantized into a scratch buffer
in ``x``'s dtype and multiplied by cuBLAS (the in-register ``tl.dot`` GEMM ran at 67-85 GB/s of
weights at M=256 on the H200, 8-9x cuBLAS's bf16 time; the scratch copy costs ~2 bf16 reads).

>>> out = w4g128_linear(x.cuda(), data.cuda())      # == gguf_reference.gguf_linear(x, data, "W4G128")
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128
GROUP_WORDS = 17  # 68 bytes
GEMV_MAX_ROWS = 4
DEQUANT_MIN_ROWS = 16


@triton.jit
def _group_tiles(rows32, g, BLOCK_N: tl.constexpr):
    """Float32 ``(w_lo, w_hi)`` ``[BLOCK_N, 64]`` of group ``g``: columns ``0..63`` and ``64..127``."""
    header = tl.load(rows32 + g * 17)                                               # [BLOCK_N]
    scale = (header & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    zero = ((header >> 16) & 0xFF).to(tl.float32)
    words = tl.load(rows32[:, None] + g * 17 + 1 + tl.arange(0, 16)[None, :])      # [BLOCK_N, 16]
    codes = (words[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 0xFF     # [BLOCK_N, 16, 4]
    low = tl.reshape(codes & 0xF, (BLOCK_N, 64)).to(tl.float32)
    high = tl.reshape(codes >> 4, (BLOCK_N, 64)).to(tl.float32)
    return (low - zero[:, None]) * scale[:, None], (high - zero[:, None]) * scale[:, None]


@triton.jit
def _w4g128_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, num_groups, stride_xm, stride_w32, stride_om,
                        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_ITER: tl.constexpr):
    """``GROUPS_PER_ITER`` groups per iteration as ``[BLOCK_N, 16 * GROUPS_PER_ITER, 4]`` code bytes
    against ``x`` loaded in the same ``[word, byte]`` layout (no reshapes); per group
    ``s * (sum(q * x) - z * sum(x))``."""
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past the end read the last row; their results are not stored.
    rows32 = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_w32
    slot = tl.arange(0, 16 * GROUPS_PER_ITER)           # word slots: group slot // 16, word slot % 16
    byte = tl.arange(0, 4)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g0 in range(0, num_groups, GROUPS_PER_ITER):
        group = g0 + slot // 16
        valid = group < num_groups
        word = rows32[:, None] + group[None, :] * 17
        header = tl.load(word, mask=valid[None, :], other=0)                                    # [BN, S]
        codes = tl.load(word + 1 + (slot % 16)[None, :], mask=valid[None, :], other=0)
        codes = (codes[:, :, None] >> (byte * 8)[None, None, :]) & 0xFF                         # [BN, S, 4]
        column = group[:, None] * 128 + (slot % 16)[:, None] * 4 + byte[None, :]                # [S, 4]
        x_lo = tl.load(x_row + column, mask=valid[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + column + 64, mask=valid[:, None], other=0.0).to(tl.float32)
        dots = tl.sum((codes & 0xF).to(tl.float32) * x_lo[None, :, :] + (codes >> 4).to(tl.float32) * x_hi[None, :, :],
                      axis=2)                                                                   # [BN, S]
        x_sums = tl.sum(x_lo + x_hi, axis=1)                                                    # [S]
        scale = (header & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        zero = ((header >> 16) & 0xFF).to(tl.float32)
        acc += tl.sum(scale * (dots - zero * x_sums[None, :]), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _w4g128_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, num_groups, stride_xm, stride_w32, stride_om,
                        HAS_BIAS: tl.constexpr, IEEE_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows32 = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_w32
    x_rows = x_ptr + tl.minimum(rm, M - 1)[:, None].to(tl.int64) * stride_xm
    half = tl.arange(0, 64)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, num_groups):
        w_lo, w_hi = _group_tiles(rows32, g, BLOCK_N)
        x_lo = tl.load(x_rows + g * 128 + half)
        x_hi = tl.load(x_rows + g * 128 + 64 + half)
        if IEEE_FP32:
            acc += tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
            acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w4g128_dequant_kernel(w_ptr, out_ptr, N, stride_w32, stride_on, BLOCK_N: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    rows32 = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_w32
    w_lo, w_hi = _group_tiles(rows32, g, BLOCK_N)
    columns = g * 128 + tl.arange(0, 64)[None, :]
    out_rows = out_ptr + rn[:, None].to(tl.int64) * stride_on
    mask = rn[:, None] < N
    tl.store(out_rows + columns, w_lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_rows + columns + 64, w_hi.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, K]`` weight of CUDA ``W4G128`` rows ``data`` in ``dtype`` (one launch)."""
    num_rows, row_bytes = data.shape
    num_groups = row_bytes // (GROUP_WORDS * 4)
    words = data.contiguous().view(torch.int32)
    out = torch.empty(num_rows, num_groups * GROUP, dtype=dtype, device=data.device)
    block_n = 32
    _w4g128_dequant_kernel[(triton.cdiv(num_rows, block_n), num_groups)](
        words, out, num_rows, words.stride(0), out.stride(0), BLOCK_N=block_n)
    return out


def w4g128_linear(x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None = None, *,
                  gemv_max_rows: int = GEMV_MAX_ROWS, block_n: int | None = None, groups_per_iter: int = 4,
                  num_warps: int = 2) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` and ``W`` as uint8 ``W4G128`` rows ``data``
    ``[N, K / 128 * 68]``; the result in ``x``'s dtype."""
    num_rows, row_bytes = data.shape
    num_groups = row_bytes // (GROUP_WORDS * 4)
    if x.dim() != 2 or x.shape[1] != num_groups * GROUP or row_bytes % (GROUP_WORDS * 4):
        raise ValueError(f"x must be [M, {num_groups * GROUP}] for this W4G128 weight, got {tuple(x.shape)}")
    x = x.contiguous()
    words = data.contiguous().view(torch.int32)                                     # [N, G * 17]
    m = x.shape[0]
    out = torch.empty(m, num_rows, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bias_arg = bias if bias is not None else out
    if m <= gemv_max_rows:
        block_n = block_n or 8  # H200, M=1, Llama-3-8B layers: 8 rows x 4 groups x 2 warps beat 16x2x4 by 3-10%
        _w4g128_gemv_kernel[(m, triton.cdiv(num_rows, block_n))](
            x, words, bias_arg, out, num_rows, num_groups, x.stride(0), words.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=block_n, GROUPS_PER_ITER=groups_per_iter, num_warps=num_warps)
        return out
    if m >= DEQUANT_MIN_ROWS and x.dtype != torch.float32:
        return torch.nn.functional.linear(x, dequantize(data, x.dtype), bias)
    block_m = 16 if m <= 16 else 64
    block_n = block_n or 64
    _w4g128_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(num_rows, block_n))](
        x, words, bias_arg, out, m, num_rows, num_groups, x.stride(0), words.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IEEE_FP32=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n)
    return out
