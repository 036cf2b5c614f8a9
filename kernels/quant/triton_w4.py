"""Triton: ``x @ W.T + bias`` for a :class:`~.w4_layout.W4Weight` (AWQ/GPTQ 4-bit, groups of 128).

What every path computes is ``w4_layout.reference_linear``. The codes become floats without an
int->float conversion (a quarter-rate instruction on Hopper): OR-ing nibble ``i`` (bits ``4 P`` of
a 16-bit half, ``P = i % 4``) into the mantissa of a float whose unit is bit ``4 P`` gives
``2^(23 - 4 P) + code`` exactly, and subtracting ``2^(23 - 4 P) + zero`` leaves ``code - zero``
(``_codes_minus_zero``): a LOP3 and an FADD a weight. The group scale multiplies each group's
float32 dot once (so the products are those of the exact ``code - zero``).

- :func:`dot_gemv` (2..``DOT_MAX_ROWS`` rows of bf16/fp16 ``x``): the tensor cores with the
  operands swapped, ``out.T = W @ x.T``: ``BLOCK_N`` weight rows on the MMA's M side, the tokens
  zero-padded to 16 on its N side; per group, nibble ``i`` of the 16 words is the ``[BLOCK_N, 16]``
  operand of 16 consecutive inputs (exact integers in ``x``'s dtype), so a group is eight K=16 dots.
  The word loads feed ``tl.dot`` and go through its pipelined asynchronous loads.
- :func:`gemv` (CUDA cores, any float ``x``, up to ``GEMV_MAX_ROWS``): the same decode, float32
  FMAs against ``x`` broadcast over each thread's rows; one row by ``_w4_gemv1_kernel``, which
  loads the next step's words while it multiplies this step's (``prefetch``).
- ``asm_decode`` (tensor-core GEMV, bf16): the codes decoded by three PTX instructions per two
  weights into a bf16x2 register (``_bf16_pair``), which stays the MMA's A operand (no shared
  memory round trip).
- More rows: the weight is dequantized into a scratch copy in ``x``'s dtype for cuBLAS.

Both GEMVs split the groups over several programs when the layer has few output tiles: each
adds its float32 partial into a zeroed workspace, and the last program of a tile (a counter)
reads the sums, clears the workspace and counter, and writes the output (no extra launch).

>>> out = w4_linear(x.cuda(), w4_layout.from_rows(rows.cuda()))   # ≈ w4_layout.reference_linear(x, ...)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemv.triton_gemv import uses_pdl
from ..triton_utils import split_k_buffers
from .w4_layout import W4Weight

GEMV_MAX_ROWS = 1   # rows the CUDA-core GEMV takes (0: the tensor-core one takes single rows too)
DOT_MAX_ROWS = 16   # rows the tensor-core GEMV takes; more dequantize for cuBLAS
# Each kernel's tiling by layer width: "narrow" up to WIDE_N output rows (Llama-3-8B qkv, o, down),
# "wide" above (gate_up). target_programs: the programs split-K aims for (0: never split).
# H200, CUDA graphs, weights cycling past L2, Llama-3-8B layers (qkv / o / gate_up / down, us), round 1:
#   M=1 bf16 16.1 / 13.4 / 55.8 / 32.4; old W4G128 kernel 20.1 / 17.8 / 82.5 / 46.7;
#       GEMV without prefetch BN128/G2/264 programs 11.2 / 8.5 / 35.1 / 21.9 (0.9-1.8 TB/s) -> layer 76.7 vs
#       117.6, few programs resident (~2 per SM) and a load-then-compute step: hence prefetch and more programs;
#       tensor-core GEMV 114-128 a layer. M=4 and 8: tensor-core BN128/W4/3 stages 114 a layer (bf16 118).
WIDE_N = 8192
# H200 round 1 (2026-12-02, same units): GEMV BN64/G2/528 programs 9.6 / 7.5 / 29.6 / 17.2 = 63.9 a layer
#   (bf16 130.2); the whole-K row kernel (row_gemv) 73.4 at its best (BN8, 16 groups a step, PDL;
#   80.6 without PDL: its [BN, groups, 16] tiles cost shared-memory layout conversions for the
#   headers and x every step, which the [BN, 16] tiles here do not); tensor-core + PTX decode 83.3.
#   Programmatic dependent launch (pdl) took 7 us off the row kernel's layer, hence on here too: H200
#   round 2, engine bs1 on the 8B shape, AWQ 2.585 ms/token (decode graph 2.652) against bf16's 4.324
#   in the same process (0.598x; 2.715 without PDL the day before).
GEMV_CONFIGS = {
    "narrow": dict(block_n=64, num_warps=4, num_stages=1, groups_per_iter=2, prefetch=True, target_programs=528,
                   pdl=True),
    "wide": dict(block_n=64, num_warps=4, num_stages=1, groups_per_iter=2, prefetch=True, target_programs=528,
                 pdl=True),
}
DOT_CONFIGS = {
    "narrow": dict(block_n=128, num_warps=4, num_stages=3, groups_per_iter=1, asm_decode=False, target_programs=264),
    "wide": dict(block_n=128, num_warps=4, num_stages=3, groups_per_iter=1, asm_decode=False, target_programs=264),
}
# The one-row kernel with whole-K programs (target_programs 0: never split) and programmatic
# dependent launch; not yet the default (ROW_GEMV False): its H200 sweep picks the configs.
ROW_GEMV = False
ROW_CONFIGS = {
    "narrow": dict(block_n=8, num_warps=4, groups_per_iter=8, target_programs=0, pdl=True),
    "wide": dict(block_n=8, num_warps=4, groups_per_iter=8, target_programs=0, pdl=True),
}
# The fused one-row kernels (prologue RMSNorm or SwiGLU, or RMSNorm with the SwiGLU epilogue: "gated").
# (The row kernel's best plain config in round 1 was 8 rows, 16 groups a step; gated: 4 outputs = 8 rows.)
FUSED_ROW_CONFIGS = {
    "narrow": dict(block_n=8, num_warps=4, groups_per_iter=16, pdl=True),
    "wide": dict(block_n=8, num_warps=4, groups_per_iter=16, pdl=True),
    "gated": dict(block_n=4, num_warps=4, groups_per_iter=16, pdl=True),
}
PLAIN, RMS_NORM, SILU_AND_MUL = 0, 1, 2  # the row kernel's PROLOGUE values
# Whether AWQ/GPTQ layers offer the fused one-row kernels to batch-size-1 decode (the RMSNorm
# prologue, SwiGLU as gate_up's epilogue or down's prologue); benchmarks A/B them.
FUSED_ROW = False
SWIGLU_EPILOGUE = True
MIN_GROUPS_PER_SPLIT = 4


def width_class(num_rows: int) -> str:
    return "wide" if num_rows > WIDE_N else "narrow"


@triton.jit
def _zero_offsets(header):
    """``(2^(23 - 4P) + zero)`` for P = 0..3, float32, from a header word (zero in bits 16..23)."""
    zero23 = (((header >> 16) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)   # 2^23 + zero
    return zero23, zero23 - 7864320.0, zero23 - 8355840.0, zero23 - 8386560.0


@triton.jit
def _scale(header):
    return (header & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble_masks(nibble):
    """``0xF << 4 P`` for P = 0..3 from the runtime ``nibble`` (= 0xF): values in registers, so
    each decode is one LOP3 with the magic as its immediate (constant masks are rematerialized:
    an extra move a weight, SASS of sm_90 shows)."""
    return nibble, nibble << 4, nibble << 8, nibble << 12


@triton.jit
def _codes_minus_zero(words, hi, z0, z1, z2, z3, m0, m1, m2, m3, I: tl.constexpr):
    """Float32 ``code - zero`` of nibble ``I`` (0..7) of ``words`` (``hi`` = ``words >> 16``);
    ``z*`` broadcast against ``words``; ``m*`` from :func:`_nibble_masks`."""
    P: tl.constexpr = I % 4
    MAGIC: tl.constexpr = (150 - 4 * P) << 23
    src = words if I < 4 else hi
    if P == 0:
        return ((src & m0) | MAGIC).to(tl.float32, bitcast=True) - z0
    elif P == 1:
        return ((src & m1) | MAGIC).to(tl.float32, bitcast=True) - z1
    elif P == 2:
        return ((src & m2) | MAGIC).to(tl.float32, bitcast=True) - z2
    else:
        return ((src & m3) | MAGIC).to(tl.float32, bitcast=True) - z3


# Nibbles P and P + 4 of a word (bits 4P and 16 + 4P) as two bf16 ``code - zero``: shift them to
# bits 0 and 16, OR them into bf16 128.0 (0x4300, whose mantissa unit is 1) and add the packed
# -(128 + zero) in one fma.bf16x2: two LOP-class instructions for two weights, exact.
_BF16_PAIR_ASM = tl.constexpr("""{
.reg .b32 t, one;
mov.b32 one, 0x3F803F80;
shr.u32 t, $2, $4;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xea;
fma.rn.bf16x2 t, t, one, $3;
mov.b32 {$0, $1}, t;
}""")


@triton.jit
def _bf16_pair(words, neg_zero_pair, shift):
    """bf16 ``code - zero`` of nibbles ``P`` and ``P + 4`` of ``words`` (``shift`` = 4 P), by PTX."""
    lo, hi = tl.inline_asm_elementwise(_BF16_PAIR_ASM, "=h,=h,r,r,r", [words, neg_zero_pair, shift],
                                       dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
    return lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True)


@triton.jit
def _finish(acc, n, t, M, N, bias_ptr, out_ptr, stride_out, ws_ptr, count_ptr, num_splits, HAS_BIAS: tl.constexpr,
            IS_SPLIT: tl.constexpr):
    """Store ``acc`` (``[BLOCK_N, BLOCK_T]`` float32, output rows ``n``, tokens ``t``) plus the
    bias; split (``num_splits`` programs a tile), through the workspace and the tile's counter (module docstring)."""
    store_mask = (t[None, :] < M) & (n[:, None] < N)
    out_ptrs = out_ptr + t[None, :].to(tl.int64) * stride_out + n[:, None]
    if IS_SPLIT:
        partial = ws_ptr + t[None, :] * N + tl.minimum(n, N - 1)[:, None]
        tl.atomic_add(partial, acc, mask=n[:, None] < N, sem="relaxed")
        tl.debug_barrier()  # every thread's partial is in before the count says so
        arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel")
        if arrived == num_splits - 1:
            zeros = tl.zeros(acc.shape, dtype=tl.float32)
            total = tl.atomic_add(partial, zeros, mask=n[:, None] < N, sem="acquire")  # read where they landed
            tl.store(partial, zeros, mask=n[:, None] < N)
            tl.atomic_xchg(count_ptr + tl.program_id(0), 0, sem="relaxed")
            if HAS_BIAS:
                total += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["M", "groups_per_split", "num_splits", "nibble"])  # one compile for 1..16 rows
def _w4_dot_kernel(x_ptr, codes_ptr, headers_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, M, N, K,
                   stride_x, stride_c, stride_out, groups_per_split, num_splits, nibble, HAS_BIAS: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_ITER: tl.constexpr, IS_SPLIT: tl.constexpr,
                   ASM_DECODE: tl.constexpr = False):
    """See :func:`dot_gemv`: ``acc[BN, BT] += scale * sum_i dot(code_i - zero, x_i.T)`` per group.
    ``ASM_DECODE`` (bf16 ``x``, CUDA only: the interpreter runs no PTX): the codes by
    :func:`_bf16_pair`, two weights in two instructions."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = tl.minimum(n, N - 1)  # rows past the end read the last row; never stored
    t = tl.arange(0, BLOCK_T)
    c = tl.arange(0, 16)
    # Padding tokens read the last row (unmasked loads); their columns are never stored.
    x_cols = x_ptr + tl.minimum(t, M - 1)[None, :].to(tl.int64) * stride_x + c[:, None]    # [16, BT]
    code_rows = codes_ptr + n_in[:, None].to(tl.int64) * stride_c + c[None, :]             # [BN, 16]
    num_groups = K // 128
    m0, m1, m2, m3 = _nibble_masks(nibble)
    g_start = tl.program_id(1) * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, num_groups)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for g0 in range(g_start, g_end, GROUPS_PER_ITER):
        for gi in tl.static_range(GROUPS_PER_ITER):
            # Unmasked loads (so they vectorize): past the split's end, its last group again, scaled by 0.
            g = tl.minimum(g0 + gi, g_end - 1)
            words = tl.load(code_rows + g * 16)                                               # [BN, 16]
            header = tl.load(headers_ptr + g * N + n_in)                                     # [BN]
            d = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            if ASM_DECODE:
                neg_zero = 0xC300 + ((header >> 16) & 0xFF)                                  # bf16 -(128 + zero)
                neg_zero_pair = (neg_zero | (neg_zero << 16))[:, None] + 0 * words
                for p in tl.static_range(4):
                    q_low, q_high = _bf16_pair(words, neg_zero_pair, 4 * p + 0 * words)
                    d = tl.dot(q_low, tl.load(x_cols + g * 128 + 16 * p), d)
                    d = tl.dot(q_high, tl.load(x_cols + g * 128 + 16 * (p + 4)), d)
            else:
                z0, z1, z2, z3 = _zero_offsets(header[:, None])
                hi = words >> 16
                for i in tl.static_range(8):
                    q = _codes_minus_zero(words, hi, z0, z1, z2, z3, m0, m1, m2, m3, i).to(x_ptr.dtype.element_ty)
                    xv = tl.load(x_cols + g * 128 + 16 * i)                                   # [16, BT]
                    d = tl.dot(q, xv, d)
            scale = _scale(header)
            if GROUPS_PER_ITER > 1:
                scale = tl.where(g0 + gi < g_end, scale, 0.0)
            acc += d * scale[:, None]
    _finish(acc, n, t, M, N, bias_ptr, out_ptr, stride_out, ws_ptr, count_ptr, num_splits, HAS_BIAS, IS_SPLIT)


@triton.jit(do_not_specialize=["groups_per_split", "num_splits", "nibble"])
def _w4_gemv_kernel(x_ptr, codes_ptr, headers_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, M, N, K,
                    stride_x, stride_c, stride_out, groups_per_split, num_splits, nibble, HAS_BIAS: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_ITER: tl.constexpr,
                    IS_SPLIT: tl.constexpr):
    """See :func:`gemv`: per group, ``d[T, BN, 16] += x_i[T, 1, 16] * (code_i - zero)[1, BN, 16]``
    over the eight nibbles, then ``acc += scale * d``; summed over the 16 words at the end. One row
    (``BLOCK_T == 1``) keeps everything two-dimensional: ``x_i`` is a ``[16]`` vector broadcast
    over the ``[BN, 16]`` words."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = tl.minimum(n, N - 1)
    t = tl.arange(0, BLOCK_T)
    c = tl.arange(0, 16)
    code_rows = codes_ptr + n_in[:, None].to(tl.int64) * stride_c + c[None, :]             # [BN, 16]
    num_groups = K // 128
    m0, m1, m2, m3 = _nibble_masks(nibble)
    g_start = tl.program_id(1) * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, num_groups)
    if BLOCK_T == 1:
        acc2 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_T, BLOCK_N, 16), dtype=tl.float32)
    for g0 in range(g_start, g_end, GROUPS_PER_ITER):
        for gi in tl.static_range(GROUPS_PER_ITER):
            g = tl.minimum(g0 + gi, g_end - 1)  # unmasked loads, as in _w4_dot_kernel
            words = tl.load(code_rows + g * 16)                                               # [BN, 16]
            header = tl.load(headers_ptr + g * N + n_in)                                     # [BN]
            z0, z1, z2, z3 = _zero_offsets(header[:, None])
            hi = words >> 16
            scale = _scale(header)
            if GROUPS_PER_ITER > 1:
                scale = tl.where(g0 + gi < g_end, scale, 0.0)
            if BLOCK_T == 1:
                d2 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
                for i in tl.static_range(8):
                    q = _codes_minus_zero(words, hi, z0, z1, z2, z3, m0, m1, m2, m3, i)
                    xv = tl.load(x_ptr + g * 128 + 16 * i + c).to(tl.float32)                 # [16]
                    d2 += q * xv[None, :]
                acc2 += d2 * scale[:, None]
            else:
                x_cols = x_ptr + tl.minimum(t, M - 1)[:, None].to(tl.int64) * stride_x + c[None, :]  # [BT, 16]
                d3 = tl.zeros((BLOCK_T, BLOCK_N, 16), dtype=tl.float32)
                for i in tl.static_range(8):
                    q = _codes_minus_zero(words, hi, z0, z1, z2, z3, m0, m1, m2, m3, i)
                    xv = tl.load(x_cols + g * 128 + 16 * i).to(tl.float32)                   # [BT, 16]
                    d3 += xv[:, None, :] * q[None, :, :]
                acc3 += d3 * scale[None, :, None]
    if BLOCK_T == 1:
        result = tl.sum(acc2, axis=1)[:, None]                                                # [BN, 1]
    else:
        result = tl.trans(tl.sum(acc3, axis=2))                                               # [BN, BT]
    _finish(result, n, t, M, N, bias_ptr, out_ptr, stride_out, ws_ptr, count_ptr, num_splits, HAS_BIAS, IS_SPLIT)


@triton.jit
def _gemv1_group(words, header, x_group, m0, m1, m2, m3, c):
    """One row's ``scale * sum_i (code_i - zero) * x_i`` of one group, ``[BN, 16]`` (words left unsummed)."""
    z0, z1, z2, z3 = _zero_offsets(header[:, None])
    hi = words >> 16
    d = tl.zeros(words.shape, dtype=tl.float32)
    for i in tl.static_range(8):
        q = _codes_minus_zero(words, hi, z0, z1, z2, z3, m0, m1, m2, m3, i)
        d += q * tl.load(x_group + 16 * i + c).to(tl.float32)[None, :]
    return d * _scale(header)[:, None]


@triton.jit(do_not_specialize=["groups_per_split", "num_splits", "nibble"])
def _w4_gemv1_kernel(x_ptr, codes_ptr, headers_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, M, N, K,
                     stride_x, stride_c, stride_out, groups_per_split, num_splits, nibble, HAS_BIAS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_ITER: tl.constexpr,
                     IS_SPLIT: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One row, as ``_w4_gemv_kernel``'s ``BLOCK_T == 1`` path, with the next step's words and
    headers loaded before this step's math (Triton pipelines only loads that feed ``tl.dot``; the
    H200 ran the unprefetched GEMV at 0.9-1.8 TB/s, a load-then-compute duty cycle). A step is one
    group (``GROUPS_PER_ITER`` 1) or two (2)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = tl.minimum(n, N - 1)
    t = tl.arange(0, BLOCK_T)
    c = tl.arange(0, 16)
    code_rows = codes_ptr + n_in[:, None].to(tl.int64) * stride_c + c[None, :]             # [BN, 16]
    header_rows = headers_ptr + n_in
    num_groups = K // 128
    m0, m1, m2, m3 = _nibble_masks(nibble)
    g_start = tl.program_id(1) * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, num_groups)
    last = g_end - 1
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    # Steps past the split's end re-read its last group (unmasked loads) and are not added.
    if USE_PDL:  # as in _w4_row_kernel: the next kernel may start; the first words before x is waited for
        tl.extra.cuda.gdc_launch_dependents()
    words_a = tl.load(code_rows + g_start * 16)
    header_a = tl.load(header_rows + g_start * N)
    if GROUPS_PER_ITER == 2:
        words_b = tl.load(code_rows + tl.minimum(g_start + 1, last) * 16)
        header_b = tl.load(header_rows + tl.minimum(g_start + 1, last) * N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for g in range(g_start, g_end, GROUPS_PER_ITER):
        g_next = tl.minimum(g + GROUPS_PER_ITER, last)
        words_next_a = tl.load(code_rows + g_next * 16)
        header_next_a = tl.load(header_rows + g_next * N)
        if GROUPS_PER_ITER == 2:
            words_next_b = tl.load(code_rows + tl.minimum(g_next + 1, last) * 16)
            header_next_b = tl.load(header_rows + tl.minimum(g_next + 1, last) * N)
        acc += _gemv1_group(words_a, header_a, x_ptr + g * 128, m0, m1, m2, m3, c)
        if GROUPS_PER_ITER == 2:
            if g + 1 < g_end:
                acc += _gemv1_group(words_b, header_b, x_ptr + (g + 1) * 128, m0, m1, m2, m3, c)
            words_b = words_next_b
            header_b = header_next_b
        words_a = words_next_a
        header_a = header_next_a
    _finish(tl.sum(acc, axis=1)[:, None], n, t, M, N, bias_ptr, out_ptr, stride_out, ws_ptr, count_ptr, num_splits,
            HAS_BIAS, IS_SPLIT)


@triton.jit
def _row_inputs(x_ptr, residual_ptr, norm_ptr, summed_ptr, idx, valid, K, is_writer,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Inputs ``idx`` of the row the weight multiplies, float32, and their squares' part of the
    RMS (0 unless RMS_NORM, and where not ``valid``): ``x``; RMSNorm's ``s * norm_weight`` with
    ``s = x + residual`` rounded to x's dtype (stored by the ``is_writer`` program as the next
    residual stream; the inverse RMS scales the finished dot); or ``silu(gate) * up`` rounded."""
    storage = x_ptr.dtype.element_ty
    first = tl.load(x_ptr + idx).to(tl.float32)
    squares = tl.zeros_like(first)
    if PROLOGUE == 2:
        up = tl.load(x_ptr + K + idx).to(tl.float32)
        row = (first * tl.sigmoid(first) * up).to(storage).to(tl.float32)
    elif PROLOGUE == 1:
        summed = first
        if HAS_RESIDUAL:
            summed = (first + tl.load(residual_ptr + idx).to(tl.float32)).to(storage)
            tl.store(summed_ptr + idx, summed, mask=valid & ((tl.zeros_like(idx) + is_writer) != 0))
            summed = summed.to(tl.float32)
        squares = tl.where(valid, summed * summed, 0.0)
        row = summed * tl.load(norm_ptr + idx).to(tl.float32)
    else:
        row = first
    return row, squares


@triton.jit
def _row_step(words, header, x_ptr, residual_ptr, norm_ptr, summed_ptr, g, valid, c, K, is_writer,
              m0, m1, m2, m3, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """``scale * sum_i (code_i - zero) * row_i`` of one row's groups ``g`` (``[BG]``), per row and
    word (``words`` ``[BN, BG, 16]``, ``header`` ``[BN, BG]``; ``[BN, BG, 16]`` float32), and the
    ``[BG, 16]`` squares of the row's inputs met (:func:`_row_inputs`)."""
    z0, z1, z2, z3 = _zero_offsets(header[:, :, None])
    hi = words >> 16
    idx = g[:, None] * 128 + c[None, :]                                                  # [BG, 16]
    group_valid = valid[:, None] & (c[None, :] < 16)
    d = tl.zeros(words.shape, dtype=tl.float32)
    squares = tl.zeros(idx.shape, dtype=tl.float32)
    for i in tl.static_range(8):
        q = _codes_minus_zero(words, hi, z0, z1, z2, z3, m0, m1, m2, m3, i)
        row, sq = _row_inputs(x_ptr, residual_ptr, norm_ptr, summed_ptr, idx + 16 * i, group_valid, K, is_writer,
                              PROLOGUE, HAS_RESIDUAL)
        d += q * row[None, :, :]
        if PROLOGUE == 1:
            squares += sq
    return d * _scale(header)[:, :, None], squares


@triton.jit(do_not_specialize=["groups_per_split", "num_splits", "nibble"])
def _w4_row_kernel(x_ptr, codes_ptr, headers_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, M, N, K,
                   stride_x, stride_c, stride_out, groups_per_split, num_splits, nibble, HAS_BIAS: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_ITER: tl.constexpr,
                   IS_SPLIT: tl.constexpr, USE_PDL: tl.constexpr, residual_ptr=None, norm_ptr=None,
                   summed_ptr=None, eps=0.0, PROLOGUE: tl.constexpr = 0, HAS_RESIDUAL: tl.constexpr = False,
                   GATED_OUT: tl.constexpr = False):
    """One row, ``BLOCK_N`` outputs a program, ``GROUPS_PER_ITER`` groups a step as one
    ``[BN, BG, 16]`` word tile (each thread holds its words of every row, so the input it loads
    serves all of them), the next step's tile loaded before this step's math. Unsplit, a program
    walks all of K (no workspace). ``USE_PDL``: the next kernel may start at once, the first tile
    is loaded before waiting for the previous kernel's ``x`` (as ``kernels/gemv/triton_gemv.py``).

    ``PROLOGUE`` (unsplit only): the row is RMSNorm(x + residual) (1; one pass, the inverse RMS
    applied to the finished dot) or ``silu(x[:K]) * x[K:]`` (2). ``GATED_OUT``: the weight is
    ``[2 N, K]`` (gate rows, then up rows) and output ``n`` is ``silu(gate_n) * up_n`` of the
    products rounded to x's dtype (tile row ``2 j`` is output ``j``'s gate row, ``2 j + 1`` its up row)."""
    if GATED_OUT:
        tile_rows = tl.arange(0, 2 * BLOCK_N)
        n = tl.program_id(0) * BLOCK_N + tile_rows // 2
        weight_rows = tl.minimum(n, N - 1) + (tile_rows % 2) * N
        num_weight_rows = 2 * N
    else:
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        weight_rows = tl.minimum(n, N - 1)
        num_weight_rows = N
    t = tl.arange(0, BLOCK_T)
    c = tl.arange(0, 16)
    gi = tl.arange(0, GROUPS_PER_ITER)
    num_groups = K // 128
    m0, m1, m2, m3 = _nibble_masks(nibble)
    g_start = tl.program_id(1) * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, num_groups)
    is_writer = ((tl.program_id(0) == 0) & (tl.program_id(1) == 0)).to(tl.int32)
    code_rows = codes_ptr + weight_rows[:, None, None].to(tl.int64) * stride_c + c[None, None, :]   # [BN, 1, 16]
    header_rows = headers_ptr + weight_rows[:, None]                                                 # [BN, 1]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    g = g_start + gi
    in_split = g < g_end
    words = tl.load(code_rows + g[None, :, None] * 16, mask=in_split[None, :, None], other=0)
    header = tl.load(header_rows + g[None, :] * num_weight_rows, mask=in_split[None, :], other=0)  # scale 0 past the end
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x (and the residual) are the previous kernel's outputs
    acc = tl.zeros(words.shape, dtype=tl.float32)
    squares = tl.zeros((GROUPS_PER_ITER, 16), dtype=tl.float32)
    for g0 in range(g_start, g_end, GROUPS_PER_ITER):
        g_next = g0 + GROUPS_PER_ITER + gi
        next_in = g_next < g_end
        words_next = tl.load(code_rows + g_next[None, :, None] * 16, mask=next_in[None, :, None], other=0)
        header_next = tl.load(header_rows + g_next[None, :] * num_weight_rows, mask=next_in[None, :], other=0)
        part, sq = _row_step(words, header, x_ptr, residual_ptr, norm_ptr, summed_ptr,
                             tl.minimum(g0 + gi, num_groups - 1), g0 + gi < g_end, c, K, is_writer,
                             m0, m1, m2, m3, PROLOGUE, HAS_RESIDUAL)
        acc += part
        if PROLOGUE == 1:
            squares += sq
        words = words_next
        header = header_next
    result = tl.sum(tl.sum(acc, axis=2), axis=1)                                             # [BN] or [2 BN]
    if PROLOGUE == 1:
        result = result * tl.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / K + eps)
    if GATED_OUT:
        storage = out_ptr.dtype.element_ty
        gate, up = tl.split(tl.reshape(result, [BLOCK_N, 2]))
        gate, up = gate.to(storage).to(tl.float32), up.to(storage).to(tl.float32)
        result = gate * tl.sigmoid(gate) * up
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _finish(result[:, None], n, t, M, N, bias_ptr, out_ptr, stride_out, ws_ptr, count_ptr, num_splits, HAS_BIAS,
            IS_SPLIT)


@triton.jit
def _w4_dequant_kernel(codes_ptr, headers_ptr, out_ptr, N, K, nibble, BLOCK_N: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = tl.minimum(n, N - 1)
    g = tl.program_id(1)
    c = tl.arange(0, 16)
    words = tl.load(codes_ptr + n_in[:, None].to(tl.int64) * (K // 8) + g * 16 + c[None, :])
    header = tl.load(headers_ptr + g * N + n_in)
    z0, z1, z2, z3 = _zero_offsets(header[:, None])
    scale = _scale(header)[:, None]
    hi = words >> 16
    m0, m1, m2, m3 = _nibble_masks(nibble)
    out_rows = out_ptr + n[:, None].to(tl.int64) * K + g * 128 + c[None, :]
    for i in tl.static_range(8):
        values = _codes_minus_zero(words, hi, z0, z1, z2, z3, m0, m1, m2, m3, i) * scale
        tl.store(out_rows + 16 * i, values.to(out_ptr.dtype.element_ty), mask=n[:, None] < N)


def dequantize(weight: W4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, K]`` weight in ``dtype`` (one launch; equal to ``w4_layout.dequantize``)."""
    num_rows, num_columns = weight.out_features, weight.in_features
    out = torch.empty(num_rows, num_columns, dtype=dtype, device=weight.codes.device)
    block_n = 32
    _w4_dequant_kernel[(triton.cdiv(num_rows, block_n), num_columns // 128)](
        weight.codes, weight.headers, out, num_rows, num_columns, 0xF, BLOCK_N=block_n)
    return out


def split_for(num_tiles: int, num_groups: int, target_programs: int) -> int:
    """Parts to split the groups in: enough programs for ``target_programs``, each part at least
    ``MIN_GROUPS_PER_SPLIT`` groups."""
    if target_programs <= 0:
        return 1
    wanted = -(-target_programs // num_tiles)
    return max(1, min(wanted, num_groups // MIN_GROUPS_PER_SPLIT))


def _launch(kernel, x, weight: W4Weight, bias, block_t: int, config: dict, split_k: int | None,
            **extra) -> torch.Tensor:
    x = x.contiguous()
    m, k = x.shape
    num_rows = weight.out_features
    out = torch.empty(m, num_rows, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, groups_per_iter = config["block_n"], config["groups_per_iter"]
    num_tiles = triton.cdiv(num_rows, block_n)
    num_groups = k // 128
    split_k = split_k or split_for(num_tiles, num_groups, config["target_programs"])
    groups_per_split = triton.cdiv(triton.cdiv(num_groups, split_k), groups_per_iter) * groups_per_iter
    split_k = triton.cdiv(num_groups, groups_per_split)
    workspace, counts = (out, out) if split_k == 1 else split_k_buffers(x.device, block_t, num_rows, num_tiles)
    if workspace is None:  # first met inside a CUDA graph capture: no persistent buffers there
        split_k, groups_per_split, workspace, counts = 1, num_groups, out, out
    kernel[(num_tiles, split_k)](
        x, weight.codes, weight.headers, bias if bias is not None else out, out, workspace, counts, m, num_rows, k,
        x.stride(0), weight.codes.stride(0), out.stride(0), groups_per_split, split_k, 0xF, HAS_BIAS=bias is not None,
        BLOCK_T=block_t, BLOCK_N=block_n, GROUPS_PER_ITER=groups_per_iter, IS_SPLIT=split_k > 1,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
        **({"ASM_DECODE": True} if config.get("asm_decode") else {}), **extra)
    return out


def _check(x: torch.Tensor, weight: W4Weight) -> None:
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [M, {weight.in_features}] for this W4 weight, got {tuple(x.shape)}")


def dot_gemv(x: torch.Tensor, weight: W4Weight, bias: torch.Tensor | None = None, *,
             split_k: int | None = None, **config) -> torch.Tensor:
    """Up to 16 rows of bf16/fp16 ``x`` on the tensor cores (``_w4_dot_kernel``); ``config``
    overrides ``DOT_CONFIGS`` (block_n, num_warps, num_stages, groups_per_iter, asm_decode,
    target_programs)."""
    _check(x, weight)
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[0] > 16:
        raise ValueError(f"dot_gemv takes up to 16 rows of bfloat16/float16 x, got {x.shape[0]} of {x.dtype}")
    if config.get("asm_decode") and (x.dtype != torch.bfloat16 or x.device.type != "cuda"):
        raise ValueError("asm_decode=True decodes to bfloat16 by PTX: it needs bfloat16 x on CUDA")
    return _launch(_w4_dot_kernel, x, weight, bias, 16, {**DOT_CONFIGS[width_class(weight.out_features)], **config}, split_k)


def gemv(x: torch.Tensor, weight: W4Weight, bias: torch.Tensor | None = None, *,
         split_k: int | None = None, **config) -> torch.Tensor:
    """A few rows of ``x`` on the CUDA cores (``_w4_gemv_kernel``, float32 FMAs); ``config``
    overrides ``GEMV_CONFIGS`` (and ``prefetch``: the one-row kernel with register prefetch)."""
    _check(x, weight)
    config = {**GEMV_CONFIGS[width_class(weight.out_features)], **config}
    if config["prefetch"] and x.shape[0] == 1:  # more rows: the kernel without prefetch
        if config["groups_per_iter"] not in (1, 2):
            raise ValueError(f"the prefetching GEMV takes 1 or 2 groups a step, got {config['groups_per_iter']}")
        use_pdl = bool(config.get("pdl")) and uses_pdl(x)
        return _launch(_w4_gemv1_kernel, x, weight, bias, 1, config, split_k, USE_PDL=use_pdl,
                       **({"launch_pdl": True} if use_pdl else {}))
    return _launch(_w4_gemv_kernel, x, weight, bias, triton.next_power_of_2(max(x.shape[0], 1)), config, split_k)


def row_gemv(x: torch.Tensor, weight: W4Weight, bias: torch.Tensor | None = None, *,
             split_k: int | None = None, **config) -> torch.Tensor:
    """One row of ``x`` on the CUDA cores (``_w4_row_kernel``); ``config`` overrides
    ``ROW_CONFIGS`` (block_n, num_warps, groups_per_iter, target_programs, pdl)."""
    _check(x, weight)
    if x.shape[0] > 1:
        raise ValueError(f"row_gemv takes one row of x, got {x.shape[0]}")
    config = {"num_stages": 1, **ROW_CONFIGS[width_class(weight.out_features)], **config}
    use_pdl = bool(config.get("pdl")) and uses_pdl(x)
    return _launch(_w4_row_kernel, x, weight, bias, 1, config, split_k, USE_PDL=use_pdl,
                   residual_ptr=x, norm_ptr=x, summed_ptr=x, **({"launch_pdl": True} if use_pdl else {}))


def _fused_row(x, weight: W4Weight, prologue: int, residual=None, norm_weight=None, eps: float = 0.0,
               gated_out: bool = False, **config) -> tuple[torch.Tensor, torch.Tensor]:
    """``_w4_row_kernel`` with a prologue (RMS_NORM, SILU_AND_MUL) and/or the SwiGLU epilogue, unsplit."""
    k = weight.in_features
    width = 2 * k if prologue == SILU_AND_MUL else k
    if x.dim() != 2 or x.shape != (1, width):
        raise ValueError(f"x must be one row [1, {width}] for this W4 weight, got {tuple(x.shape)}")
    if gated_out and weight.out_features % 2:
        raise ValueError(f"a gated weight stacks gate and up rows ([2 * I, K]), got {weight.out_features} rows")
    x = x.contiguous()
    has_residual = prologue == RMS_NORM and residual is not None
    summed = x
    if prologue == RMS_NORM:
        if norm_weight is None or norm_weight.shape != (k,):
            raise ValueError(f"norm_weight must be ({k},), got {None if norm_weight is None else tuple(norm_weight.shape)}")
        if has_residual:
            if residual.shape != x.shape:
                raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
            residual = residual.contiguous()
            summed = torch.empty_like(x)
    config = {**FUSED_ROW_CONFIGS["gated" if gated_out else width_class(weight.out_features)], **config}
    num_outputs = weight.out_features // 2 if gated_out else weight.out_features
    out = torch.empty(1, num_outputs, dtype=x.dtype, device=x.device)
    use_pdl = bool(config.get("pdl")) and uses_pdl(x)
    num_groups = k // 128
    _w4_row_kernel[(triton.cdiv(num_outputs, config["block_n"]), 1)](
        x, weight.codes, weight.headers, out, out, out, out, 1, num_outputs, k, x.stride(0), weight.codes.stride(0),
        out.stride(0), num_groups, 1, 0xF, HAS_BIAS=False, BLOCK_T=1, BLOCK_N=config["block_n"],
        GROUPS_PER_ITER=config["groups_per_iter"], IS_SPLIT=False, USE_PDL=use_pdl,
        residual_ptr=residual if has_residual else x, norm_ptr=norm_weight.contiguous() if norm_weight is not None else x,
        summed_ptr=summed, eps=eps, PROLOGUE=prologue, HAS_RESIDUAL=has_residual, GATED_OUT=gated_out,
        num_warps=config["num_warps"], num_stages=1, **({"launch_pdl": True} if use_pdl else {}))
    return out, summed


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: W4Weight, **config) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(x + residual) @ W.T, x + residual)`` for one row in one launch; what
    ``kernels/gemv/reference.rms_norm_linear`` computes (the normed row not rounded: one pass)."""
    return _fused_row(x, weight, RMS_NORM, residual, norm_weight, eps, **config)


def rms_norm_linear_silu_and_mul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                                 eps: float, weight: W4Weight, **config) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu(g) * u, x + residual)`` where ``[g, u] = RMSNorm(x + residual) @ W.T`` (``W``
    ``[2 I, K]``, gate rows first) for one row in one launch."""
    return _fused_row(x, weight, RMS_NORM, residual, norm_weight, eps, gated_out=True, **config)


def silu_and_mul_linear(x: torch.Tensor, weight: W4Weight, **config) -> torch.Tensor:
    """``(silu(x[:, :K]) * x[:, K:]) @ W.T`` for one row ``[1, 2 K]`` in one launch."""
    return _fused_row(x, weight, SILU_AND_MUL, **config)[0]


def w4_linear(x: torch.Tensor, weight: W4Weight, bias: torch.Tensor | None = None, *,
              gemv_max_rows: int | None = None, dot_max_rows: int | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]``, the result in ``x``'s dtype: up to ``gemv_max_rows``
    rows the CUDA-core GEMV, up to ``dot_max_rows`` (bf16/fp16) the tensor-core one, more rows
    dequantize a scratch weight for cuBLAS."""
    _check(x, weight)
    m = x.shape[0]
    gemv_max_rows = GEMV_MAX_ROWS if gemv_max_rows is None else gemv_max_rows
    dot_max_rows = DOT_MAX_ROWS if dot_max_rows is None else dot_max_rows
    if m == 1 and ROW_GEMV and gemv_max_rows >= 1:
        return row_gemv(x, weight, bias)
    if m <= gemv_max_rows:
        return gemv(x, weight, bias)
    if m <= min(dot_max_rows, 16) and x.dtype in (torch.bfloat16, torch.float16):
        return dot_gemv(x, weight, bias)
    return torch.nn.functional.linear(x, dequantize(weight, x.dtype), bias)
