"""Triton: the FP8 W8A8 linear of ``fp8.py`` in fewer launches.

What every path computes is ``fp8.fp8_linear_reference``, vLLM's dynamic per-token FP8: each row of
``x`` is quantized to e4m3 with scale ``amax(|x_row|) / 448``, the codes are multiplied by the e4m3
weight with per-output-row scales, and ``out = (x_codes @ W_codes.T) * x_scale * w_scale (+ bias)``.

- :func:`quantize_rows` — one launch per call (``fp8.quantize_rows`` in torch is seven: abs, amax,
  divide, clamp, divide, clamp, cast), the same scales and codes (one may sit an e4m3 step away
  where the quotient is a rounding tie: it multiplies by the reciprocal of the scale).
- :func:`dot_gemv` — bf16 ``x`` and the e4m3 weight in one launch: each program takes the rows'
  amax itself and quantizes its ``x`` slices, then the tensor cores multiply with the operands
  swapped (weight rows on the MMA's M side, up to 16 tokens padded on its N side), so the weight
  streams through ``tl.dot``'s pipelined asynchronous loads (a CUDA-core GEMV could not keep
  enough bytes in flight: 1.0-1.4 TB/s against 2-3.4).
- :func:`row_gemv` — the same for one row (batch-size-1 decode), optionally with the op before
  the matmul computed on the way in, as ``kernels/gemv`` does for bf16: RMSNorm(x + residual)
  (:func:`rms_norm_linear`) or SwiGLU (:func:`silu_and_mul_linear`). The row is quantized as a
  vector (not as 16 padded rows), only the first of the MMA's 16 columns is live, and split-K
  reduces one float32 per output. Per-shape tiles: :data:`ROW_LAUNCHES`.
- :func:`codes_gemm` — rows quantized by :func:`quantize_rows`, then the same swapped-operand MMA
  on both e4m3 operands straight from memory, for decode batches of a few dozen rows.
- The old GEMV of pre-quantized codes (``_fp8_gemv_kernel``) and ``torch._scaled_mm``
  (cuBLASLt row-wise), which wins once the step is compute-bound.
``fp8_linear`` picks by the number of rows (1: ``row_gemv``, up to ``DOT_MAX_ROWS``: ``dot_gemv``,
up to ``CODES_GEMM_MAX_ROWS``: ``codes_gemm``, then ``_scaled_mm``).

>>> out = fp8_linear(x.cuda(), weight_fp8.cuda(), weight_scale.cuda())  # ≈ fp8.fp8_linear_reference(...)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..triton_utils import split_k_buffers
from .fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

# Single-row steps of layers up to this many weights take the GEMV. Measured on the H200 (CUDA
# graphs, Llama-3-8B layers, us): M=1 qkv 16.1 vs 21.7 (_scaled_mm, with the quantizer), o 14.2 vs
# 16.8, but gate_up 59.3 vs 49.4 and down 56.9 vs 50.9; at 4-8 rows the GEMV falls to ~200-390 GB/s.
GEMV_MAX_ROWS = 1
GEMV_MAX_WEIGHTS = 1 << 25
# Steps of up to DOT_MAX_ROWS rows take the tensor-core GEMV, the rest the quantizer + _scaled_mm.
# H200, CUDA graphs, weights cycling past L2, Llama-3-8B layers (qkv / o / gate_up / down, us):
#   M=1: bf16 15.5 / 13.4 / 56.0 / 31.4; quantizer + _scaled_mm 21.9 / 18.3 / 49.5 / 52.6;
#        dot 11.3 / 10.6 / 34.3 / 28.6 (2.2 / 1.6 / 3.4 / 2.1 TB/s) -> layer 85 vs bf16's 116
#   M=4: _scaled_mm 141 per layer, dot 116;  M=16: _scaled_mm 136, dot 155 (the amax pass is per row).
#   A CUDA-core fused GEMV (e4m3 -> f32 converts, same fused quantization) ran 175 per layer at M=1.
DOT_MAX_ROWS = 4
DOT_BLOCK_N = 64
DOT_NUM_WARPS = 4
# (block_k, stages) by output rows: 512/3 won on the 4096-6144-row layers, 256/4 on gate_up's 28672.
DOT_WIDE_N = 8192
DOT_TILES = {False: (512, 3), True: (256, 4)}
# Quantize by multiplying with the reciprocal of the scale (as torch's CUDA division by a scalar
# does); div_rn in this loop made the kernel 5-8x slower (its slow path is a call).
DOT_RECIP = True
# The same for the standalone quantizer in front of _scaled_mm (steps of more rows).
QUANTIZE_RECIP = True
# Layers of up to DOT_SPLIT_MAX_N output rows (qkv, o, down: 96 or 64 tiles of 64 rows for 132 SMs)
# split K in DOT_SPLIT_K parts (see the kernel: the last part reduces, no extra launch).
DOT_SPLIT_K = 2
DOT_SPLIT_MAX_N = 8192


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_columns, stride_x, stride_q,
                          FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, BLOCK: tl.constexpr,
                          RECIP: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_columns, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < num_columns, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    # IEEE-rounded divisions (Triton's ``/`` is the approximate one): the codes must be torch's.
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX_C), MIN_SCALE_C)
    tl.store(scale_ptr + row, scale)
    inverse_scale = tl.math.div_rn(1.0, scale)
    for start in range(0, num_columns, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < num_columns, other=0.0).to(tl.float32)
        if RECIP:  # times the rounded reciprocal, as the GEMVs quantize (DOT_RECIP)
            q = tl.clamp(v * inverse_scale, -FP8_MAX_C, FP8_MAX_C)
        else:
            q = tl.clamp(tl.math.div_rn(v, tl.zeros_like(v) + scale), -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < num_columns)


@triton.jit
def _fp8_gemv_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, num_rows_x, num_rows, num_columns,
                     stride_x, stride_w, stride_out, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for start in range(0, num_columns, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :],
                    mask=(n[:, None] < num_rows) & (k[None, :] < num_columns), other=0.0).to(tl.float32)
        x = tl.load(xq_ptr + m[:, None] * stride_x + k[None, :],
                    mask=(m[:, None] < num_rows_x) & (k[None, :] < num_columns), other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    x_scale = tl.load(xs_ptr + m, mask=m < num_rows_x, other=0.0)
    w_scale = tl.load(ws_ptr + n, mask=n < num_rows, other=0.0)
    out = acc * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n < num_rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + m[:, None] * stride_out + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < num_rows_x) & (n[None, :] < num_rows))


@triton.jit
def _fp8_dot_gemv_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                         FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         AMAX_BLOCK: tl.constexpr, RECIP: tl.constexpr, SPLIT_K: tl.constexpr,
                         ws_ptr32, count_ptr, k_per_split):
    """``fp8.fp8_linear_reference``'s math with the activation quantization fused in (every program
    takes each live row's amax over all of ``K`` itself, ``x`` being a few KiB in L2, and quantizes
    its slices), on the tensor cores with the operands swapped: ``out.T = W @ x_codes.T`` with
    ``BLOCK_N`` weight rows as the MMA's M side and the ``M <= BLOCK_T`` tokens (zero-padded) as its
    N side, so the weight tiles stream through the pipelined loads that feed ``tl.dot`` and no
    weight is converted on the CUDA cores. The e4m3 products are exact; the accumulation is the
    tensor cores' (as ``torch._scaled_mm``'s). ``RECIP``: quantize by multiplying with the rounded
    reciprocal of the scale (what torch's CUDA division by a scalar does) instead of ``div_rn``.

    ``SPLIT_K > 1`` (layers with few output rows fill more SMs): program axis 1 takes
    ``k_per_split`` columns and adds its float32 partial into the zeroed workspace ``ws_ptr32``
    ``[BLOCK_T, N]``; the last program of an output tile (a per-tile counter in ``count_ptr``)
    reads the sums back (an atomic add of zero), zeroes the workspace and the counter and writes
    the output: no extra launch, the buffers clean for the next call."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    x_rows = x_ptr + tl.minimum(t, M - 1)[:, None].to(tl.int64) * stride_x                 # [BT, 1]
    w_rows = w_ptr + tl.minimum(n, N - 1)[:, None].to(tl.int64) * stride_w                 # [BN, 1]
    live = (t < M)[:, None]
    # Each live row's amax over all of K (one row at a time: padding rows are never read).
    ka = tl.arange(0, AMAX_BLOCK)
    scale = tl.full((BLOCK_T,), MIN_SCALE_C, dtype=tl.float32)
    for r in range(0, M):
        row_max = tl.zeros((AMAX_BLOCK,), dtype=tl.float32)
        for start in range(0, K, AMAX_BLOCK):
            v = tl.load(x_ptr + r * stride_x + start + ka, mask=start + ka < K, other=0.0)
            row_max = tl.maximum(row_max, tl.abs(v.to(tl.float32)))
        row_scale = tl.maximum(tl.math.div_rn(tl.max(row_max, axis=0), FP8_MAX_C), MIN_SCALE_C)
        scale = tl.where(t == r, row_scale, scale)                                          # [BT]
    if RECIP:
        scale_b = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32) + tl.math.div_rn(1.0, scale)[:, None]
    else:
        scale_b = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32) + scale[:, None]
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for start in range(k_start, k_end, BLOCK_K):
        k = start + k0
        w = tl.load(w_rows + k[None, :], mask=k[None, :] < k_end, other=0.0)              # [BN, BK] e4m3
        v = tl.load(x_rows + k[None, :], mask=live & (k[None, :] < k_end), other=0.0).to(tl.float32)
        if RECIP:
            q = tl.clamp(v * scale_b, -FP8_MAX_C, FP8_MAX_C).to(w_ptr.dtype.element_ty)
        else:
            q = tl.clamp(tl.math.div_rn(v, scale_b), -FP8_MAX_C, FP8_MAX_C).to(w_ptr.dtype.element_ty)
        acc = tl.dot(w, tl.trans(q), acc)                                                  # [BN, BT]
    store_mask = (t[None, :] < M) & (n[:, None] < N)
    if SPLIT_K > 1:
        partial = ws_ptr32 + t[None, :] * N + tl.minimum(n, N - 1)[:, None]               # [BN, BT]
        tl.atomic_add(partial, acc, mask=n[:, None] < N, sem="relaxed")
        tl.debug_barrier()  # every thread's partial is in before the count says so
        arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # The sums, read where the atomics landed (L2), then zeroed for the next call.
            zeros = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            acc = tl.atomic_add(partial, zeros, mask=n[:, None] < N, sem="acquire")
            tl.store(partial, zeros, mask=n[:, None] < N)
            tl.atomic_xchg(count_ptr + tl.program_id(0), 0, sem="relaxed")
            w_scale = tl.load(ws_ptr + n, mask=n < N, other=0.0)
            out = acc * w_scale[:, None] * scale[None, :]
            if HAS_BIAS:
                out += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + t[None, :] * stride_out + n[:, None], out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        w_scale = tl.load(ws_ptr + n, mask=n < N, other=0.0)
        out = acc * w_scale[:, None] * scale[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + t[None, :] * stride_out + n[:, None], out.to(out_ptr.dtype.element_ty), mask=store_mask)


def dot_gemv(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, *, block_n: int | None = None, block_k: int | None = None,
             num_warps: int | None = None, num_stages: int | None = None, recip: bool | None = None,
             split_k: int | None = None) -> torch.Tensor:
    """``fp8.fp8_linear_reference(x, ...)`` for up to 16 rows of CUDA ``x`` in one launch (the
    quantization fused, see ``_fp8_dot_gemv_kernel``); the result in ``x``'s dtype."""
    x = x.contiguous()
    m, k = x.shape
    num_rows = weight_fp8.shape[0]
    out = torch.empty(m, num_rows, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n = block_n or DOT_BLOCK_N
    tile_k, stages = DOT_TILES[num_rows > DOT_WIDE_N]
    block_k = min(block_k or tile_k, triton.next_power_of_2(k))
    block_t = max(16, triton.next_power_of_2(m))
    num_tiles = triton.cdiv(num_rows, block_n)
    if split_k is None:
        split_k = DOT_SPLIT_K if num_rows <= DOT_SPLIT_MAX_N else 1
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    workspace, counts = (out, out) if split_k == 1 else split_k_buffers(x.device, block_t, num_rows, num_tiles)
    if workspace is None:  # first met inside a CUDA graph capture: no persistent buffers there
        split_k, k_per_split, workspace, counts = 1, k, out, out
    _fp8_dot_gemv_kernel[(num_tiles, split_k)](
        x, weight_fp8, weight_scale.float().contiguous(), bias if bias is not None else out, out, m, num_rows, k,
        x.stride(0), weight_fp8.stride(0), out.stride(0), FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
        AMAX_BLOCK=min(4096, triton.next_power_of_2(k)), RECIP=DOT_RECIP if recip is None else recip,
        SPLIT_K=split_k, ws_ptr32=workspace, count_ptr=counts, k_per_split=k_per_split,
        num_warps=num_warps or DOT_NUM_WARPS,
        num_stages=num_stages or stages)
    return out


# One-row GEMV (``row_gemv``). PROLOGUE values: what the row is before it is quantized.
PLAIN = 0         # x itself
RMS_NORM = 1      # RMSNorm(x + residual) * norm_weight, rounded where kernels.rms_norm stores it
SILU_AND_MUL = 2  # silu(x[:K]) * x[K:2K], rounded where kernels.silu_and_mul stores it
# Off: one-row steps take the tensor-core GEMV of several rows (``dot_gemv``), as before.
ROW_GEMV = True


@dataclass(frozen=True, slots=True)
class RowLaunch:
    """Tile of one program of the one-row GEMV (``block_n`` weight rows, K walked ``block_k`` at a
    time, ``num_stages`` loads in flight), the number of K parts (``split_k``) and whether the row's
    next tile is loaded a step ahead (``prefetch``)."""

    block_n: int = 64
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    prefetch: bool = True


# Launches by weight shape (N, K); others take :func:`row_launch`'s rule. The Llama-3-8B shapes
# are the H200 round-1 sweep's winners (benchmarks/quant_kernels.py --part fp8-row, CUDA graphs,
# weights cycling past L2, us at one row; bf16 cuBLAS beside): qkv 10.9 (2.3 TB/s; 11.0-13.9 for
# the others tried; bf16 16.2), o 8.8 (1.9 TB/s; 9.0-9.2; bf16 13.1), gate_up 31.4 with 128-row
# tiles of 128 columns (3.7 TB/s; 64-row tiles 33.3-40.3; bf16 55.6), down 20.4 (2.9 TB/s;
# 20.9-25.9; bf16 31.5): 71.5 a layer against 116.4 for bf16 and 80.9 for the first guesses. The
# row's prefetch was even (qkv 11.2 either way). In the engine (bs1, 8B): 3.36 ms/token against
# 3.55 for the several-row GEMV (dot_gemv) that ran one-row steps before, at the first guesses.
ROW_LAUNCHES: dict[tuple[int, int], RowLaunch] = {
    (6144, 4096): RowLaunch(64, 256, 4, 4, 4),
    (4096, 4096): RowLaunch(64, 256, 4, 4, 4),
    (28672, 4096): RowLaunch(128, 128, 8, 4, 1),
    (4096, 14336): RowLaunch(64, 512, 4, 3, 4),
}


def row_launch(num_rows: int, k: int) -> RowLaunch:
    """The launch for an ``[num_rows, k]`` weight: the table's, else the sweep's pattern: wide
    weights (more than DOT_WIDE_N rows) in 128-row, 128-column tiles unsplit; the others in 64-row,
    256-column tiles with K split so that about two programs run on each of 132 SMs (at most 8
    parts of at least 1024 columns)."""
    known = ROW_LAUNCHES.get((num_rows, k))
    if known is not None:
        return known
    if num_rows > DOT_WIDE_N:
        return RowLaunch(128, 128, 8, 4, 1)
    tiles = triton.cdiv(num_rows, 64)
    return RowLaunch(64, 256, 4, 4, max(1, min(8, 264 // tiles, k // 1024)))


@triton.jit
def _row_inputs(x_ptr, residual_ptr, norm_ptr, cols, mask, K, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The loads behind columns ``cols`` of the row, in float32 (see :func:`_row_from`); the ones a
    prologue does not use are ``x``'s again (no load)."""
    first = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    second, third = first, first
    if PROLOGUE == 2:
        second = tl.load(x_ptr + K + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        if HAS_RESIDUAL:
            second = tl.load(residual_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            third = tl.load(norm_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return first, second, third


@triton.jit
def _row_from(x_ptr, first, second, third, inverse_rms, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The row the weight multiplies, in float32, from :func:`_row_inputs`' loads, each intermediate
    rounded to x's dtype where the unfused kernels store it (``inverse_rms``: RMS_NORM only)."""
    storage = x_ptr.dtype.element_ty
    if PROLOGUE == 2:
        row = (first * tl.sigmoid(first) * second).to(storage).to(tl.float32)
    else:
        row = first
        if HAS_RESIDUAL:
            row = (row + second).to(storage).to(tl.float32)
        if PROLOGUE == 1:
            row = ((row * inverse_rms).to(storage).to(tl.float32) * third).to(storage).to(tl.float32)
    return row


@triton.jit
def _row_values(x_ptr, residual_ptr, norm_ptr, cols, mask, K, inverse_rms,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Columns ``cols`` of the row the weight multiplies (:func:`_row_inputs`, then :func:`_row_from`)."""
    first, second, third = _row_inputs(x_ptr, residual_ptr, norm_ptr, cols, mask, K, PROLOGUE, HAS_RESIDUAL)
    return _row_from(x_ptr, first, second, third, inverse_rms, PROLOGUE, HAS_RESIDUAL)


@triton.jit
def _fp8_row_gemv_kernel(x_ptr, residual_ptr, norm_ptr, summed_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,
                         N, K, eps, stride_w, ws32_ptr, count_ptr, k_per_split,
                         PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                         FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PASS_BLOCK: tl.constexpr, SPLIT_K: tl.constexpr,
                         EVEN_K: tl.constexpr, PREFETCH: tl.constexpr):
    """``out[0, n] = fp8_linear_reference(row, W)[n]`` for the one ``row`` of the prologue.

    Every program first walks the whole row in L2 (a few KiB): its sum of squares (RMS_NORM; the
    program (0, 0) also stores x + residual, the next residual stream), then its amax, which gives
    the per-token scale. The main loop quantizes ``BLOCK_K`` columns of the row as a vector and
    puts them in column 0 of a 16-column e4m3 tile (the MMA's narrowest N; the other 15 are zero),
    so the weight tile ``[BLOCK_N, BLOCK_K]`` streams through ``tl.dot``'s pipelined loads as in
    ``_fp8_dot_gemv_kernel``. Split-K as there, on one float32 per output.

    ``EVEN_K``: every part is whole ``BLOCK_K`` tiles (no masks on the weight loads, which keeps
    them 16-byte vectors). ``PREFETCH``: the row's loads for the next tile are issued before this
    tile's quantization and MMA, so their L2 latency overlaps the loop instead of adding to it."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    kp = tl.arange(0, PASS_BLOCK)
    inverse_rms = 1.0
    if PROLOGUE == 1:
        is_writer = ((pid_n == 0) & (pid_k == 0)).to(tl.int32)
        squares = tl.zeros((PASS_BLOCK,), dtype=tl.float32)
        for start in range(0, K, PASS_BLOCK):
            cols = start + kp
            summed = _row_values(x_ptr, residual_ptr, norm_ptr, cols, cols < K, K, 1.0,
                                 PROLOGUE=0, HAS_RESIDUAL=HAS_RESIDUAL)
            squares += summed * summed
            if HAS_RESIDUAL:
                writes = (cols < K) & (tl.zeros_like(cols) + is_writer != 0)
                tl.store(summed_ptr + cols, summed.to(summed_ptr.dtype.element_ty), mask=writes)
        inverse_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    row_max = tl.zeros((PASS_BLOCK,), dtype=tl.float32)
    for start in range(0, K, PASS_BLOCK):
        cols = start + kp
        v = _row_values(x_ptr, residual_ptr, norm_ptr, cols, cols < K, K, inverse_rms,
                        PROLOGUE=PROLOGUE, HAS_RESIDUAL=HAS_RESIDUAL)
        row_max = tl.maximum(row_max, tl.abs(v))
    scale = tl.maximum(tl.math.div_rn(tl.max(row_max, axis=0), FP8_MAX_C), MIN_SCALE_C)
    inverse_scale = tl.math.div_rn(1.0, scale)  # DOT_RECIP's quantization: times the reciprocal

    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(n, N - 1)[:, None].to(tl.int64) * stride_w                 # [BN, 1]
    is_first_column = (tl.arange(0, 16) == 0)[:, None]                                      # [16, 1]
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH:
        first, second, third = _row_inputs(x_ptr, residual_ptr, norm_ptr, k_start + k0, k_start + k0 < k_end, K,
                                           PROLOGUE, HAS_RESIDUAL)
    for start in range(k_start, k_end, BLOCK_K):
        k = start + k0
        in_part = k < k_end
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])                                                # [BN, BK] e4m3
        else:
            w = tl.load(w_rows + k[None, :], mask=in_part[None, :], other=0.0)
        if PREFETCH:
            v = _row_from(x_ptr, first, second, third, inverse_rms, PROLOGUE, HAS_RESIDUAL)
            ahead = k + BLOCK_K
            first, second, third = _row_inputs(x_ptr, residual_ptr, norm_ptr, ahead, ahead < k_end, K,
                                               PROLOGUE, HAS_RESIDUAL)
        else:
            v = _row_values(x_ptr, residual_ptr, norm_ptr, k, in_part, K, inverse_rms,
                            PROLOGUE=PROLOGUE, HAS_RESIDUAL=HAS_RESIDUAL)
        q = tl.clamp(v * inverse_scale, -FP8_MAX_C, FP8_MAX_C).to(w_ptr.dtype.element_ty)
        # The row as column 0 of a [16, BK] tile: selected as bytes (a zero byte is e4m3 zero).
        q_bits = tl.where(is_first_column, q.to(tl.uint8, bitcast=True)[None, :], 0).to(tl.uint8)
        acc = tl.dot(w, tl.trans(q_bits.to(w_ptr.dtype.element_ty, bitcast=True)), acc)   # [BN, 16]
    total = tl.sum(acc, axis=1)  # column 0; the others are zero
    if SPLIT_K > 1:
        tl.atomic_add(ws32_ptr + n, total, mask=n < N, sem="relaxed")
        tl.debug_barrier()  # every thread's partial is in before the count says so
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            zeros = tl.zeros((BLOCK_N,), dtype=tl.float32)
            total = tl.atomic_add(ws32_ptr + n, zeros, mask=n < N, sem="acquire")
            tl.store(ws32_ptr + n, zeros, mask=n < N)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed")
            out = total * tl.load(ws_ptr + n, mask=n < N, other=0.0) * scale
            if HAS_BIAS:
                out += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
            tl.store(out_ptr + n, out.to(out_ptr.dtype.element_ty), mask=n < N)
    else:
        out = total * tl.load(ws_ptr + n, mask=n < N, other=0.0) * scale
        if HAS_BIAS:
            out += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, out.to(out_ptr.dtype.element_ty), mask=n < N)


def row_gemv(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, *, prologue: int = PLAIN, residual: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             launch: RowLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8_linear_reference(row, W) + bias, summed)`` for the one row ``x`` ``[1, K]`` (SwiGLU:
    ``[1, 2K]``) in one launch, the row being ``x`` (PLAIN), ``RMSNorm(x + residual)`` (RMS_NORM;
    ``summed`` is ``x + residual``, or ``x`` when residual is None) or ``silu(gate) * up``
    (SILU_AND_MUL); ``summed`` is ``x`` but for RMS_NORM with a residual."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be one row [1, K], got {tuple(x.shape)}")
    num_rows, k = weight_fp8.shape
    width = 2 * k if prologue == SILU_AND_MUL else k
    if x.shape[1] != width:
        raise ValueError(f"x must be [1, {width}] for this FP8 weight {tuple(weight_fp8.shape)}, got {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(1, num_rows, dtype=x.dtype, device=x.device)
    summed = x
    has_residual = prologue == RMS_NORM and residual is not None
    if has_residual:
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
        residual = residual.contiguous()
        summed = torch.empty_like(x)
    if prologue == RMS_NORM and (norm_weight is None or norm_weight.shape != (k,)):
        raise ValueError(f"norm_weight must be ({k},) for RMS_NORM, got "
                         f"{None if norm_weight is None else tuple(norm_weight.shape)}")
    launch = launch or row_launch(num_rows, k)
    block_k = min(launch.block_k, triton.next_power_of_2(k))
    num_tiles = triton.cdiv(num_rows, launch.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, launch.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    workspace, counts = (out, out) if split_k == 1 else split_k_buffers(x.device, 1, num_rows, num_tiles)
    if workspace is None:  # first met inside a CUDA graph capture: no persistent buffers there
        split_k, k_per_split, workspace, counts = 1, k, out, out
    _fp8_row_gemv_kernel[(num_tiles, split_k)](
        x, residual if has_residual else x, norm_weight.contiguous() if norm_weight is not None else x, summed,
        weight_fp8, weight_scale.float().contiguous(), bias if bias is not None else out, out,
        num_rows, k, eps, weight_fp8.stride(0), workspace, counts, k_per_split,
        PROLOGUE=prologue, HAS_RESIDUAL=has_residual, HAS_BIAS=bias is not None, FP8_MAX_C=FP8_MAX,
        MIN_SCALE_C=MIN_SCALE, BLOCK_N=launch.block_n, BLOCK_K=block_k,
        PASS_BLOCK=min(4096, triton.next_power_of_2(k)), SPLIT_K=split_k,
        EVEN_K=k % k_per_split == 0 and k_per_split % block_k == 0, PREFETCH=launch.prefetch,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out, summed


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8_linear(RMSNorm(x + residual)), x + residual)`` for one row in one launch; what
    ``kernels.rms_norm`` then :func:`fp8_linear` compute.

    >>> out, summed = rms_norm_linear(hidden, residual, norm.weight, norm.eps, weight_fp8, weight_scale)
    """
    return row_gemv(x, weight_fp8, weight_scale, bias, prologue=RMS_NORM, residual=residual,
                    norm_weight=norm_weight, eps=eps)


def silu_and_mul_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_linear(silu(x[:, :K]) * x[:, K:])`` for one row ``[1, 2K]`` in one launch."""
    return row_gemv(x, weight_fp8, weight_scale, bias, prologue=SILU_AND_MUL)[0]


# torch._scaled_mm's fast accumulation (the partial sums kept in the tensor cores' reduced precision
# between promotions), as vLLM's sm90 CUTLASS FP8 GEMMs run (their FP8FastAccum schedules).
SCALED_MM_FAST_ACCUM = False

# Steps of DOT_MAX_ROWS < M <= CODES_GEMM_MAX_ROWS rows: the quantizer, then the swapped-operand
# tensor-core GEMM of the codes (``codes_gemm``) instead of ``_scaled_mm``; 0 keeps _scaled_mm.
# H200 round 1, 32 rows, Llama-3-8B layers (quantizer included, us): qkv 16.8 vs 18.1, o 14.2 vs
# 15.8, gate_up 36.6 vs 49.7, down 29.7 vs 44.3 -> 97.5 a layer vs 127.8 (benchmarks/quant_kernels.py
# --part fp8-small-m). Measured at 32 rows only; 64 keeps the token tile at most 64 wide, where the
# step is still a weight read (cuBLAS takes over as it turns compute-bound).
CODES_GEMM_MAX_ROWS = 64


@triton.jit
def _fp8_codes_gemm_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, ws32_ptr, count_ptr,
                           M, N, K, stride_x, stride_w, stride_out, k_per_split,
                           HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``out.T = (W_codes @ x_codes.T) * w_scale * x_scale (+ bias)`` for pre-quantized rows: the
    weight's ``BLOCK_N`` rows on the MMA's M side, the ``M <= BLOCK_T`` tokens on its N side
    (padding columns read the last row again and are never stored), both operands e4m3 straight
    from memory, so the loop is two pipelined loads and an MMA. Split-K as ``_fp8_dot_gemv_kernel``."""
    pid_n = tl.program_id(0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    w_rows = w_ptr + tl.minimum(n, N - 1)[:, None].to(tl.int64) * stride_w                 # [BN, 1]
    x_rows = xq_ptr + tl.minimum(t, M - 1)[:, None].to(tl.int64) * stride_x                # [BT, 1]
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for start in range(k_start, k_end, BLOCK_K):
        k = start + k0
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])
            xq = tl.load(x_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=(k < k_end)[None, :], other=0.0)
            xq = tl.load(x_rows + k[None, :], mask=(k < k_end)[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(xq), acc)                                                  # [BN, BT]
    live = (t[None, :] < M) & (n[:, None] < N)
    if SPLIT_K > 1:
        partial = ws32_ptr + t[None, :] * N + tl.minimum(n, N - 1)[:, None]
        tl.atomic_add(partial, acc, mask=live, sem="relaxed")
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            zeros = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            acc = tl.atomic_add(partial, zeros, mask=live, sem="acquire")
            tl.store(partial, zeros, mask=live)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed")
            out = (acc * tl.load(ws_ptr + n, mask=n < N, other=0.0)[:, None]
                   * tl.load(xs_ptr + t, mask=t < M, other=0.0)[None, :])
            if HAS_BIAS:
                out += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + t[None, :] * stride_out + n[:, None], out.to(out_ptr.dtype.element_ty), mask=live)
    else:
        out = (acc * tl.load(ws_ptr + n, mask=n < N, other=0.0)[:, None]
               * tl.load(xs_ptr + t, mask=t < M, other=0.0)[None, :])
        if HAS_BIAS:
            out += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + t[None, :] * stride_out + n[:, None], out.to(out_ptr.dtype.element_ty), mask=live)


def codes_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
               block_n: int = 64, block_k: int = 256, num_warps: int = 4, num_stages: int = 4,
               split_k: int | None = None) -> torch.Tensor:
    """``(x_fp8 @ W.T) * x_scale * w_scale + bias`` for up to 128 rows of e4m3 codes ``x_fp8``
    ``[M, K]`` (``quantize_rows``'s) in one launch; see ``_fp8_codes_gemm_kernel``. ``split_k``
    None: K split so that about 264 programs run (two an SM), at most 8 parts."""
    m, k = x_fp8.shape
    num_rows = weight_fp8.shape[0]
    if m > 128:
        raise ValueError(f"codes_gemm takes at most 128 rows, got {m}")
    out = torch.empty(m, num_rows, dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return out
    block_t = max(16, triton.next_power_of_2(m))
    block_k = min(block_k, triton.next_power_of_2(k))
    num_tiles = triton.cdiv(num_rows, block_n)
    if split_k is None:
        split_k = max(1, min(8, 264 // num_tiles, k // 1024))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    workspace, counts = (out, out) if split_k == 1 else split_k_buffers(x_fp8.device, block_t, num_rows, num_tiles)
    if workspace is None:
        split_k, k_per_split, workspace, counts = 1, k, out, out
    _fp8_codes_gemm_kernel[(num_tiles, split_k)](
        x_fp8, x_scale, weight_fp8, weight_scale.float().contiguous(), bias if bias is not None else out, out,
        workspace, counts, m, num_rows, k, x_fp8.stride(0), weight_fp8.stride(0), out.stride(0), k_per_split,
        HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        EVEN_K=k % k_per_split == 0 and k_per_split % block_k == 0, num_warps=num_warps, num_stages=num_stages)
    return out


def quantize_rows(x: torch.Tensor, recip: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [M, K], float32 scales [M])`` of a CUDA ``x`` ``[M, K]``; as ``fp8.quantize_rows``
    (``recip``, default :data:`QUANTIZE_RECIP`: times the reciprocal of the scale instead of an
    IEEE division per element, which made prefill-sized calls compute-bound)."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX_C=FP8_MAX,
                                    MIN_SCALE_C=MIN_SCALE, BLOCK=min(1024, triton.next_power_of_2(k)),
                                    RECIP=QUANTIZE_RECIP if recip is None else recip)
    return q, scale


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, gemv_max_rows: int = GEMV_MAX_ROWS,
               dot_max_rows: int = DOT_MAX_ROWS, codes_gemm_max_rows: int | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for CUDA ``x`` ``[M, K]`` and the e4m3 ``weight_fp8`` ``[N, K]`` with
    float32 ``weight_scale`` ``[N]``; the result in ``x``'s dtype (see the module docstring)."""
    if x.dim() != 2 or x.shape[1] != weight_fp8.shape[1]:
        raise ValueError(f"x must be [M, {weight_fp8.shape[1]}] for this FP8 weight, got {tuple(x.shape)}")
    m = x.shape[0]
    if m == 1 and ROW_GEMV and dot_max_rows >= 1 and x.shape[1] >= 32:
        return row_gemv(x, weight_fp8, weight_scale, bias)[0]
    if 0 < m <= min(dot_max_rows, 16) and x.shape[1] >= 32:  # tl.dot takes e4m3 K tiles of 32+
        return dot_gemv(x, weight_fp8, weight_scale, bias)
    x_fp8, x_scale = quantize_rows(x)
    codes_gemm_max_rows = CODES_GEMM_MAX_ROWS if codes_gemm_max_rows is None else codes_gemm_max_rows
    if max(dot_max_rows, 1) < m <= min(codes_gemm_max_rows, 128) and x.shape[1] >= 32:
        return codes_gemm(x_fp8, x_scale, weight_fp8, weight_scale, bias, x.dtype)
    if m > gemv_max_rows or weight_fp8.numel() > GEMV_MAX_WEIGHTS:
        out = torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a=x_scale[:, None],
                               scale_b=weight_scale.float()[None, :], out_dtype=torch.bfloat16,
                               use_fast_accum=SCALED_MM_FAST_ACCUM)
        if bias is not None:
            out = out + bias
        return out if out.dtype == x.dtype else out.to(x.dtype)
    num_rows = weight_fp8.shape[0]
    out = torch.empty(m, num_rows, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    m_pad = triton.next_power_of_2(m)
    block_n, block_k = (16, 512) if m_pad <= 2 else (8, 256)
    _fp8_gemv_kernel[(triton.cdiv(num_rows, block_n),)](
        x_fp8, x_scale, weight_fp8, weight_scale.float().contiguous(), bias if bias is not None else out, out, m, num_rows,
        weight_fp8.shape[1], x_fp8.stride(0), weight_fp8.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
