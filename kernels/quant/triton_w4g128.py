"""Triton: ``x @ W.T + bias`` for ``W4G128`` rows (AWQ/GPTQ 4-bit, groups of 128), reading words.

A group is 68 bytes = 17 int32 words: word 0 holds the float16 scale and the zero point, words
1..16 the codes, byte ``j`` of them element ``j`` (low nibble) and ``j + 64`` (high nibble).

- Up to ``GEMV_MAX_ROWS`` rows: a GEMV over all rows at once. Each nibble becomes a float without
  an int->float conversion (those run at a quarter of the FMA rate on Hopper): OR-ing it into the
  mantissa of a float with the right exponent gives ``2^e + q`` exactly, and subtracting
  ``2^e + zero`` gives ``q - zero`` (``_nibbles_minus``); so a weight costs a LOP3, an FADD and an
  FFMA. ``_w4g128_gemv_j4_kernel`` (the default) walks a group's 16 words as four quarters so a
  thread keeps its (row, group) pairs and decodes each scale and zero once per group;
  ``_w4g128_gemv_kernel`` (``variant="v1"``) decodes them per word. Optional split-K adds float32
  partials atomically.
- More rows: the weight is dequantized into a scratch buffer in ``x``'s dtype (float32 included)
  and multiplied by cuBLAS (the in-register ``tl.dot`` GEMM this replaced ran at 67-85 GB/s of
  weights at M=256 on the H200, 8-9x cuBLAS's bf16 time; the scratch copy costs ~2 bf16 reads).

>>> out = w4g128_linear(x.cuda(), data.cuda())      # == gguf_reference.gguf_linear(x, data, "W4G128")
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128
GROUP_WORDS = 17  # 68 bytes
# H200, CUDA graphs, weights cycling past L2, Llama-3-8B layers (qkv / o / gate_up / down, us):
#   M=1: bf16 16.4 / 13.3 / 56.7 / 31.8; v1 BN8 20.1 / 19.5 / 82.2 / 59.2; j4 BN16 22.6 / 18.0 / 100.3 / 56.2;
#        j4 BN16 split-K 2 30.3 / 17.8 / 95.1 / 46.8 (~500-760 GB/s of packed weight: latency-bound);
#   M=4: j4 393-455 per layer; M=16: dequantize + cuBLAS 292 per layer (bf16 119).
GEMV_MAX_ROWS = 2
GEMV_PREFETCH = True
# The GEMV's tiling by output rows: layers of up to 4096 rows (o, down) take j4 with split-K 2.
GEMV_NARROW_N = 4096
GEMV_CONFIGS = {True: dict(variant="j4", block_n=16, groups_per_iter=8, num_warps=4, split_k=2),
                False: dict(variant="v1", block_n=8, groups_per_iter=8, num_warps=4, split_k=1)}


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
def _nibbles_minus(half, zero, P: tl.constexpr):
    """Float32 ``q - zero`` of nibble ``P`` (0..3) of the low 16 bits of ``half``, without an
    int->float conversion (1/4-rate on Hopper): OR the masked nibble into the mantissa of a float
    whose unit is bit ``4 P`` (exponent ``23 - 4 P``), giving ``2^(23 - 4P) + q`` exactly, and
    subtract ``2^(23 - 4P) + zero`` (``zero`` is a float32 broadcast, exact for 0..255)."""
    MAGIC: tl.constexpr = (150 - 4 * P) << 23
    f = ((half & (0xF << (4 * P))) | MAGIC).to(tl.float32, bitcast=True)
    return f - zero


@triton.jit
def _words_dot(lo, hi, z0, z1, z2, z3, xcol, xm):
    """``sum((q - zero) * x)`` term by term for code words whose low halves are ``lo`` and high
    halves ``hi`` (8 nibbles a word): word j of a group holds bytes 4j..4j+3, byte b is column
    4j + b (low nibble) and 4j + b + 64 (high nibble); ``xcol`` points at column 4j of each row."""
    d = _nibbles_minus(lo, z0, 0)[None] * tl.load(xcol, mask=xm, other=0.0).to(tl.float32)[:, None]
    d += _nibbles_minus(lo, z1, 1)[None] * tl.load(xcol + 64, mask=xm, other=0.0).to(tl.float32)[:, None]
    d += _nibbles_minus(lo, z2, 2)[None] * tl.load(xcol + 1, mask=xm, other=0.0).to(tl.float32)[:, None]
    d += _nibbles_minus(lo, z3, 3)[None] * tl.load(xcol + 65, mask=xm, other=0.0).to(tl.float32)[:, None]
    d += _nibbles_minus(hi, z0, 0)[None] * tl.load(xcol + 2, mask=xm, other=0.0).to(tl.float32)[:, None]
    d += _nibbles_minus(hi, z1, 1)[None] * tl.load(xcol + 66, mask=xm, other=0.0).to(tl.float32)[:, None]
    d += _nibbles_minus(hi, z2, 2)[None] * tl.load(xcol + 3, mask=xm, other=0.0).to(tl.float32)[:, None]
    d += _nibbles_minus(hi, z3, 3)[None] * tl.load(xcol + 67, mask=xm, other=0.0).to(tl.float32)[:, None]
    return d


@triton.jit
def _store_rows(result, bias_ptr, out_ptr, rm, rn, M, N, split, stride_om, HAS_BIAS: tl.constexpr,
                SPLIT_K: tl.constexpr):
    """``result`` ([M_PAD, BLOCK_N] float32) plus the bias (once, by split 0) into ``out``: stored, or
    added in float32 when the groups are split over programs."""
    if HAS_BIAS:
        if split == 0:
            result += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out, result.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, result, mask=mask, sem="relaxed")


@triton.jit
def _w4g128_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, num_groups, groups_per_split, stride_xm, stride_w32,
                        stride_om, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                        GROUPS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr):
    """All ``M`` rows of ``x`` against ``BLOCK_N`` weight rows, ``GROUPS_PER_ITER`` groups a step, as
    ``[BLOCK_N, GROUPS_PER_ITER, 16]`` code words (each word's 8 nibbles decoded in place, see
    ``_nibbles_minus``) against the ``x`` values those nibbles multiply; per word
    ``scale * sum((q - zero) * x)`` accumulates element-wise and is reduced once at the end.
    ``SPLIT_K > 1``: program axis 1 takes ``groups_per_split`` groups and adds into float32 ``out``."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    # Rows past the end read the last row (no load mask); their results are not stored.
    rows32 = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_w32                    # [BN]
    rm = tl.arange(0, M_PAD)
    x_rows = x_ptr + tl.minimum(rm, M - 1).to(tl.int64) * stride_xm                     # [MP]
    gi = tl.arange(0, GROUPS_PER_ITER)
    j = tl.arange(0, 16)
    acc = tl.zeros((M_PAD, BLOCK_N, GROUPS_PER_ITER, 16), dtype=tl.float32)
    g_start = split * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, num_groups)
    # The next step's words are loaded before this step's math (PREFETCH), so each program keeps
    # two steps of weight bytes in flight.
    group = g_start + gi
    word = rows32[:, None] + group[None, :] * 17
    header_next = tl.load(word, mask=(group < g_end)[None, :], other=0)
    words_next = tl.load(word[:, :, None] + 1 + j[None, None, :], mask=(group < g_end)[None, :, None], other=0)
    for g0 in range(g_start, g_end, GROUPS_PER_ITER):
        group = g0 + gi                                                                  # [GPI]
        valid = group < g_end
        if PREFETCH:
            header = header_next
            words = words_next
            after = group + GROUPS_PER_ITER
            word = rows32[:, None] + after[None, :] * 17
            header_next = tl.load(word, mask=(after < g_end)[None, :], other=0)
            words_next = tl.load(word[:, :, None] + 1 + j[None, None, :], mask=(after < g_end)[None, :, None],
                                 other=0)
        else:
            word = rows32[:, None] + group[None, :] * 17                                 # [BN, GPI]
            header = tl.load(word, mask=valid[None, :], other=0)
            words = tl.load(word[:, :, None] + 1 + j[None, None, :], mask=valid[None, :, None], other=0)
        scale = (header & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)  # 0 where masked
        zero = ((header >> 16) & 0xFF).to(tl.float32)
        # Word j of a group holds bytes 4j..4j+3: byte b is column 4j + b (low nibble) and 4j + b + 64.
        xcol = x_rows[:, None, None] + (group * 128)[None, :, None] + 4 * j[None, None, :]  # [MP, GPI, 16]
        xm = valid[None, :, None] & (rm < M)[:, None, None]
        lo = words
        hi = words >> 16
        z0 = (zero + 8388608.0)[:, :, None]
        z1 = (zero + 524288.0)[:, :, None]
        z2 = (zero + 32768.0)[:, :, None]
        z3 = (zero + 2048.0)[:, :, None]
        d = _words_dot(lo, hi, z0, z1, z2, z3, xcol, xm)
        acc += scale[None, :, :, None] * d
    _store_rows(tl.sum(tl.sum(acc, axis=3), axis=2), bias_ptr, out_ptr, rm, rn, M, N, split, stride_om,
                HAS_BIAS, SPLIT_K)


@triton.jit
def _w4g128_gemv_j4_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, num_groups, groups_per_split, stride_xm,
                           stride_w32, stride_om, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr,
                           BLOCK_N: tl.constexpr, GROUPS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr,
                           PREFETCH: tl.constexpr):
    """As ``_w4g128_gemv_kernel``, but each group's 16 code words are taken as four
    ``[BLOCK_N, GROUPS_PER_ITER, 4]`` quarters in an unrolled loop, so a thread keeps the same
    (row, group) pairs for all 16 words: the scale and zero of a pair are decoded once per group,
    not once per word, and each ``x`` value loaded serves the thread's rows."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows32 = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_w32                    # [BN]
    rm = tl.arange(0, M_PAD)
    x_rows = x_ptr + tl.minimum(rm, M - 1).to(tl.int64) * stride_xm                     # [MP]
    gi = tl.arange(0, GROUPS_PER_ITER)
    ji = tl.arange(0, 4)
    acc = tl.zeros((M_PAD, BLOCK_N, GROUPS_PER_ITER, 4), dtype=tl.float32)
    g_start = split * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, num_groups)
    for g0 in range(g_start, g_end, GROUPS_PER_ITER):
        group = g0 + gi                                                                  # [GPI]
        valid = group < g_end
        word = rows32[:, None] + group[None, :] * 17                                     # [BN, GPI]
        header = tl.load(word, mask=valid[None, :], other=0)
        scale = (header & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)  # 0 where masked
        # 2^23 + zero by the same mantissa trick as the codes (no int->float conversion).
        zero23 = (((header >> 16) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
        z0 = zero23[:, :, None]
        z1 = (zero23 - 7864320.0)[:, :, None]   # 2^19 + zero
        z2 = (zero23 - 8355840.0)[:, :, None]   # 2^15 + zero
        z3 = (zero23 - 8386560.0)[:, :, None]   # 2^11 + zero
        xm = valid[None, :, None] & (rm < M)[:, None, None]
        scale4 = scale[None, :, :, None]
        for jo in tl.static_range(4):
            words = tl.load(word[:, :, None] + 1 + 4 * jo + ji[None, None, :], mask=valid[None, :, None],
                            other=0)                                                     # [BN, GPI, 4]
            # Word j of a group holds bytes 4j..4j+3: byte b is column 4j + b (low nibble) and 4j + b + 64.
            xcol = x_rows[:, None, None] + (group * 128)[None, :, None] + 4 * (4 * jo + ji)[None, None, :]
            hi = words >> 16
            dot = _words_dot(words, hi, z0, z1, z2, z3, xcol, xm)
            acc += scale4 * dot
    _store_rows(tl.sum(tl.sum(acc, axis=3), axis=2), bias_ptr, out_ptr, rm, rn, M, N, split, stride_om,
                HAS_BIAS, SPLIT_K)


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
                  gemv_max_rows: int = GEMV_MAX_ROWS, block_n: int | None = None, groups_per_iter: int | None = None,
                  num_warps: int | None = None, split_k: int | None = None, prefetch: bool | None = None,
                  variant: str | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` and ``W`` as uint8 ``W4G128`` rows ``data``
    ``[N, K / 128 * 68]``; the result in ``x``'s dtype. Up to ``gemv_max_rows`` rows take the GEMV
    (the keywords after it tune it), more rows dequantize into a scratch weight for cuBLAS."""
    num_rows, row_bytes = data.shape
    num_groups = row_bytes // (GROUP_WORDS * 4)
    if x.dim() != 2 or x.shape[1] != num_groups * GROUP or row_bytes % (GROUP_WORDS * 4):
        raise ValueError(f"x must be [M, {num_groups * GROUP}] for this W4G128 weight, got {tuple(x.shape)}")
    m = x.shape[0]
    if m > gemv_max_rows:
        return torch.nn.functional.linear(x, dequantize(data, x.dtype), bias)
    x = x.contiguous()
    words = data.contiguous().view(torch.int32)                                     # [N, G * 17]
    out = torch.empty(m, num_rows, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    m_pad = triton.next_power_of_2(m)
    config = GEMV_CONFIGS[num_rows <= GEMV_NARROW_N]
    block_n = block_n or config["block_n"]
    groups_per_iter = groups_per_iter or config["groups_per_iter"]
    split_k = split_k or config["split_k"]
    groups_per_split = triton.cdiv(triton.cdiv(num_groups, split_k), groups_per_iter) * groups_per_iter
    split_k = triton.cdiv(num_groups, groups_per_split)
    target = out if split_k == 1 else torch.zeros(m, num_rows, dtype=torch.float32, device=x.device)
    kernel = _w4g128_gemv_j4_kernel if (variant or config["variant"]) == "j4" else _w4g128_gemv_kernel
    kernel[(triton.cdiv(num_rows, block_n), split_k)](
        x, words, bias if bias is not None else out, target, m, num_rows, num_groups, groups_per_split, x.stride(0),
        words.stride(0), target.stride(0), HAS_BIAS=bias is not None, M_PAD=m_pad, BLOCK_N=block_n,
        GROUPS_PER_ITER=groups_per_iter, SPLIT_K=split_k, PREFETCH=GEMV_PREFETCH if prefetch is None else prefetch,
        num_warps=num_warps or config["num_warps"])
    return out if split_k == 1 else target.to(x.dtype)
