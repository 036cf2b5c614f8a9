"""Triton: ``x @ W.T + bias`` straight from block rows (GGUF's, and W4G128: AWQ/GPTQ repacked),
dequantizing in registers.

The weight stays as its file's bytes (uint8 ``[N, row_bytes]``, see ``gguf_reference.py`` for the
layouts); each program decodes the ``[BLOCK_N, BLOCK_K]`` tile it needs (scales and codes are
gathered byte by byte, so one decoder per format covers every tile position) and multiplies it
in ``x``'s dtype with float32 accumulation. Steps of a few rows (decode) take a GEMV kernel
without ``tl.dot``'s 16-row minimum; larger ones a tiled GEMM.

>>> out = gguf_linear(x.cuda(), data.cuda(), "Q4_K")     # == gguf_reference.gguf_linear(...)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gguf_reference import block_format

QTYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7, "W4G128": 8}

# At most this many rows take the GEMV kernel (each row decodes the weight again).
GEMV_MAX_ROWS = 4


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _f16_at(ptr):
    bits = tl.load(ptr).to(tl.uint16) | (tl.load(ptr + 1).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(blk, s):
    """Q4_K/Q5_K: sub-block ``s``'s 6-bit scale and min from the 12 bytes at ``blk + 4``."""
    a = _byte(blk + 4 + s)
    b = _byte(blk + 8 + s)
    c = _byte(blk + 4 + s % 4)
    sc = tl.where(s < 4, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(s < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode(row_ptr, k, QTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, TYPE_SIZE: tl.constexpr):
    """float32 weights at rows ``row_ptr`` (byte pointers ``[BN, 1]``) and columns ``k`` (``[1, BK]``)."""
    blk = row_ptr + (k // BLOCK_SIZE) * TYPE_SIZE
    j = k % BLOCK_SIZE
    if QTYPE == 0:  # Q4_0
        q = (_byte(blk + 2 + j % 16) >> ((j // 16) * 4)) & 0xF
        w = _f16_at(blk) * (q - 8).to(tl.float32)
    elif QTYPE == 1:  # Q4_1
        q = (_byte(blk + 4 + j % 16) >> ((j // 16) * 4)) & 0xF
        w = _f16_at(blk) * q.to(tl.float32) + _f16_at(blk + 2)
    elif QTYPE == 2:  # Q5_0
        high = (_byte(blk + 2 + j // 8) >> (j % 8)) & 1
        q = ((_byte(blk + 6 + j % 16) >> ((j // 16) * 4)) & 0xF) | (high << 4)
        w = _f16_at(blk) * (q - 16).to(tl.float32)
    elif QTYPE == 3:  # Q5_1
        high = (_byte(blk + 4 + j // 8) >> (j % 8)) & 1
        q = ((_byte(blk + 8 + j % 16) >> ((j // 16) * 4)) & 0xF) | (high << 4)
        w = _f16_at(blk) * q.to(tl.float32) + _f16_at(blk + 2)
    elif QTYPE == 4:  # Q8_0
        q = tl.load(blk + 2 + j).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * _f16_at(blk)
    elif QTYPE == 5:  # Q4_K
        s = j // 32
        q = (_byte(blk + 16 + (j // 64) * 32 + j % 32) >> ((s % 2) * 4)) & 0xF
        sc, mn = _k_scale_min(blk, s)
        w = (_f16_at(blk) * sc) * q.to(tl.float32) - _f16_at(blk + 2) * mn
    elif QTYPE == 6:  # Q5_K
        s = j // 32
        high = (_byte(blk + 16 + j % 32) >> s) & 1
        q = ((_byte(blk + 48 + (j // 64) * 32 + j % 32) >> ((s % 2) * 4)) & 0xF) | (high << 4)
        sc, mn = _k_scale_min(blk, s)
        w = (_f16_at(blk) * sc) * q.to(tl.float32) - _f16_at(blk + 2) * mn
    elif QTYPE == 8:  # W4G128 (AWQ/GPTQ repacked)
        q = (_byte(blk + 4 + j % 64) >> ((j // 64) * 4)) & 0xF
        w = _f16_at(blk) * (q - _byte(blk + 2)).to(tl.float32)
    else:  # Q6_K
        h = j // 128
        g = (j % 128) // 32
        low = (_byte(blk + h * 64 + (g % 2) * 32 + j % 32) >> ((g // 2) * 4)) & 0xF
        high = (_byte(blk + 128 + h * 32 + j % 32) >> (2 * g)) & 3
        scale = tl.load(blk + 192 + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
        w = (_f16_at(blk + 208) * scale) * ((low | (high << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _gguf_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, QTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      TYPE_SIZE: tl.constexpr, IEEE_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows past the end read the last row (no masks in the decoder); their results are not stored.
    row_ptr = w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + tl.minimum(rm, M - 1)[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk[None, :]
        x = tl.load(x_rows + k)
        w = _decode(row_ptr, k, QTYPE, BLOCK_SIZE, TYPE_SIZE).to(x.dtype)
        if IEEE_FP32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gguf_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, QTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      TYPE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ptr = w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk[None, :]
        x = tl.load(x_ptr + m * stride_xm + k).to(tl.float32)
        w = _decode(row_ptr, k, QTYPE, BLOCK_SIZE, TYPE_SIZE)
        acc += tl.sum(w * x, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


def gguf_linear(x: torch.Tensor, data: torch.Tensor, quant_type: str, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` and ``W`` given as uint8 block rows ``data``
    ``[N, row_bytes]`` of ``quant_type``; the result is in ``x``'s dtype."""
    if quant_type == "W4G128":  # word-wise tiles, not the byte-gathering decoder below
        from .triton_w4g128 import w4g128_linear

        return w4g128_linear(x, data, bias)
    fmt = block_format(quant_type)
    num_rows, num_columns = data.shape[0], fmt.num_columns(data.shape[1])
    if x.dim() != 2 or x.shape[1] != num_columns:
        raise ValueError(f"x must be [M, {num_columns}] for this {quant_type} weight, got {tuple(x.shape)}")
    x = x.contiguous()
    data = data.contiguous()
    m = x.shape[0]
    out = torch.empty(m, num_rows, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_k = 64 if num_columns % 64 == 0 else 32
    common = dict(HAS_BIAS=bias is not None, QTYPE=QTYPE_IDS[quant_type], BLOCK_SIZE=fmt.block_size,
                  TYPE_SIZE=fmt.type_size)
    bias_arg = bias if bias is not None else out
    if m <= GEMV_MAX_ROWS:
        block_n = 32
        grid = (m, triton.cdiv(num_rows, block_n))
        _gguf_gemv_kernel[grid](x, data, bias_arg, out, num_rows, num_columns, x.stride(0), data.stride(0),
                                out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, **common)
        return out
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(num_rows, block_n))
    _gguf_gemm_kernel[grid](x, data, bias_arg, out, m, num_rows, num_columns, x.stride(0), data.stride(0),
                            out.stride(0), IEEE_FP32=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
                            BLOCK_K=block_k, **common)
    return out
