"""Triton: causal attention over the paged KV cache (tiled prefill, split-K decode), from bf16/fp16/fp32
or fp8 caches; see ``reference.py``.

Launch shapes were measured on an H200; every kernel accepts any strides and dtypes the reference
does, and all arithmetic is fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..triton_utils import LOG2_E, next_power_of_2, tanh
from . import reference

# Launch shapes, measured on an H200 with head_dim 128 (bf16): a prefill program takes
# PREFILL_BLOCK_M rows of (query token, head of the GQA group) and walks keys PREFILL_BLOCK_N at a time.
# (H200, Llama-3-8B shape, round 2: M128/N32 ran a 2048-token chunk over 8192 keys at 250 TFLOP/s
# and 30 prompts U[100,1024] at 172, against 185 and 136 for M64/N32 and 178 and 107 for M128/N64.)
PREFILL_BLOCK_M = 128
PREFILL_BLOCK_N = 32
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 2
# Prefill only: move the running max (and rescale the accumulator) only when a row's max grows by
# more than 2^LAZY_RESCALE_LOG2 (see _attend_to_key_range). Off until the H200 says.
PREFILL_LAZY_RESCALE = False
LAZY_RESCALE_LOG2: tl.constexpr = tl.constexpr(8.0)
# Heads wider than 128 keep the fp32 accumulator and the tiles in registers with smaller tiles, and
# fp32 inputs (twice the bytes per tile in shared memory) keep the tiles measured before.
PREFILL_WIDE_BLOCK_M = 64
PREFILL_WIDE_BLOCK_N = 16
PREFILL_FP32_BLOCK_M = 64
PREFILL_FP32_BLOCK_N = 32


@triton.jit
def _attend_to_key_range(
    acc, row_max, row_sum, query, query_pos,
    key_start, key_end,
    key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
    block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
    MASK_BY_QUERY_POSITION: tl.constexpr, HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_IN_FP32: tl.constexpr, USE_DOT: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
):
    """Online-softmax accumulation of ``query`` rows over cache positions [key_start, key_end).

    With USE_DOT the scores and outputs are ``tl.dot`` products (at least 16 rows); without it,
    broadcast multiply-and-sum on CUDA cores, for a decode group of 2 or 4 heads that would fill
    1/8 or 1/4 of a 16-row dot (``query`` then fp32).

    Scores are kept in the log2 domain (scaled by scale * log2(e)) so exp2 replaces exp; a soft
    cap c makes them ``c * tanh(scale * q.k / c)``, with ``soft_cap_log2`` = c * log2(e).
    ``row_max`` starts at -inf; rows that see no key stay at acc = 0, row_sum = 0.

    With LAZY_RESCALE the running max moves (and acc and row_sum are rescaled) only in a tile where
    some row's max grows by more than :data:`LAZY_RESCALE_LOG2` (FlashAttention-4's trick); until
    then probabilities are taken against the stale max, so they stay below 2^LAZY_RESCALE_LOG2. The
    same softmax in exact arithmetic, and most tiles skip the rescale of the whole accumulator.
    """
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    for tile_start in range(key_start, key_end, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        is_key_in_range = key_pos < key_end
        # Keys are gathered one position at a time through the block table, so a tile may
        # straddle cache blocks and BLOCK_N need not match block_size.
        block = tl.load(block_table_ptr + key_pos // block_size, mask=is_key_in_range, other=0).to(tl.int64)
        slot_in_block = key_pos % block_size
        load_mask = is_key_in_range[:, None] & dim_mask[None, :]
        key = tl.load(
            key_cache_ptr + block[:, None] * key_cache_stride_block + slot_in_block[:, None] * key_cache_stride_slot
            + kv_head * key_cache_stride_head + dims[None, :] * key_cache_stride_dim,
            mask=load_mask, other=0.0,
        ).to(query.dtype)
        if not USE_DOT:
            scores = tl.sum(query[:, None, :] * key[None, :, :], 2)  # [M, N]
        elif DOT_IN_FP32:
            scores = tl.dot(query.to(tl.float32), tl.trans(key.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(query, tl.trans(key))
        if HAS_SOFT_CAP:
            scores = tanh(scores * (softmax_scale_log2 / soft_cap_log2)) * soft_cap_log2
        else:
            scores = scores * softmax_scale_log2

        is_visible = is_key_in_range[None, :]
        if MASK_BY_QUERY_POSITION:
            is_visible = is_visible & (key_pos[None, :] <= query_pos[:, None])
            if HAS_SLIDING_WINDOW:
                is_visible = is_visible & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        scores = tl.where(is_visible, scores, float("-inf"))

        if LAZY_RESCALE:
            tile_max = tl.max(scores, 1)
            if tl.max((tile_max > row_max + LAZY_RESCALE_LOG2).to(tl.int32), 0) > 0:
                new_max = tl.maximum(row_max, tile_max)
                safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
                rescale = tl.exp2(row_max - safe_max)
                row_sum = row_sum * rescale
                acc = acc * rescale[:, None]
                row_max = new_max
            safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
            probs = tl.exp2(scores - safe_max[:, None])
            row_sum = row_sum + tl.sum(probs, 1)
            new_max = row_max  # acc is already at row_max's scale
        else:
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            # A row that has seen no visible key yet keeps max -inf; subtracting 0 instead of -inf
            # keeps its probabilities at exp2(-inf) = 0 rather than NaN.
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp2(scores - safe_max[:, None])
            rescale = tl.exp2(row_max - safe_max)
            row_sum = row_sum * rescale + tl.sum(probs, 1)

        value = tl.load(
            value_cache_ptr + block[:, None] * value_cache_stride_block
            + slot_in_block[:, None] * value_cache_stride_slot
            + kv_head * value_cache_stride_head + dims[None, :] * value_cache_stride_dim,
            mask=load_mask, other=0.0,
        ).to(query.dtype)
        if LAZY_RESCALE:
            if DOT_IN_FP32:
                acc = tl.dot(probs.to(query.dtype).to(tl.float32), value.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(probs.to(query.dtype), value, acc)
        elif not USE_DOT:
            acc = acc * rescale[:, None] + tl.sum(probs[:, :, None] * value[None, :, :], 1)
        elif DOT_IN_FP32:
            probs_of_dot_dtype = probs.to(query.dtype).to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(probs_of_dot_dtype, value.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(probs.to(query.dtype), value)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _as_fp16(query):
    """bf16 queries as fp16, for dots with an fp8 cache: e4m3 converts to fp16 in one packed
    instruction per pair (to bf16 it takes several), and fp16 holds every e4m3 value and more of
    the query's bits; saturated, as a bf16 query may exceed fp16's range."""
    return tl.minimum(tl.maximum(query.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _find_sequence_of_query_tile(query_start_loc_ptr, tile_index, num_seqs, BLOCK_Q: tl.constexpr):
    """Binary search for the sequence owning a query tile.

    Sequence b's tiles are numbered from ``query_start_loc[b] // BLOCK_Q + b``: increasing in b, with
    room for all of b's tiles, and at most T // BLOCK_Q + B tiles in all, so the grid needs no
    host-side look at query lengths.
    """
    low = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        first_tile = tl.load(query_start_loc_ptr + middle) // BLOCK_Q + middle
        if first_tile <= tile_index:
            low = middle + 1
        else:
            high = middle
    return low - 1


# num_seqs changes every step; specializing on it (== 1, multiple of 16) would compile new
# variants mid-run.
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    kv_scales_ptr, num_seqs,
    out_stride_token, out_stride_head, out_stride_dim,
    query_stride_token, query_stride_head, query_stride_dim,
    block_tables_stride_seq,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
    num_queries_per_kv, block_size: tl.constexpr, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
    HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_KV_SCALES: tl.constexpr,
    BLOCK_Q: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, FP8_DOT_IN_FP16: tl.constexpr, LAZY_RESCALE: tl.constexpr,
):
    """One program: BLOCK_Q consecutive query tokens of one sequence, for all query heads that
    share one KV head (GQA), so every key tile loaded serves GROUP_SIZE heads at once."""
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence_of_query_tile(query_start_loc_ptr, tile_index, num_seqs, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    tile_in_seq = tile_index - (query_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    # Rows are (token, head of the group) pairs, heads fastest.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_SIZE
    rows = tl.arange(0, BLOCK_M)
    token_in_seq = tile_in_seq * BLOCK_Q + rows // GROUP_SIZE
    head_in_group = rows % GROUP_SIZE
    is_real_row = (token_in_seq < query_len) & (head_in_group < num_queries_per_kv)
    head = kv_head * num_queries_per_kv + head_in_group
    token = (query_start + token_in_seq).to(tl.int64)
    # The new tokens are the last query_len positions of the sequence's context.
    query_pos = context_len - query_len + token_in_seq

    dims = tl.arange(0, BLOCK_D)
    row_mask = is_real_row[:, None] & (dims[None, :] < head_dim)
    query = tl.load(
        query_ptr + token[:, None] * query_stride_token + head[:, None] * query_stride_head
        + dims[None, :] * query_stride_dim,
        mask=row_mask, other=0.0,
    )
    if FP8_DOT_IN_FP16:
        query = _as_fp16(query)

    first_query_pos = context_len - query_len + tile_in_seq * BLOCK_Q
    last_query_pos = context_len - query_len + tl.minimum((tile_in_seq + 1) * BLOCK_Q, query_len) - 1
    # Keys [key_start, key_end) are seen by some row of the tile; keys [all_start, all_end) by every
    # row, so only the two edges (the causal diagonal and the window's trailing edge) need masks.
    key_start = 0
    all_start = 0
    if HAS_SLIDING_WINDOW:
        key_start = tl.maximum(first_query_pos - sliding_window + 1, 0)
        all_start = tl.minimum(tl.maximum(last_query_pos - sliding_window + 1, 0), first_query_pos + 1)
    all_end = first_query_pos + 1
    key_end = last_query_pos + 1

    value_scale = 1.0
    if HAS_KV_SCALES:  # dequantizing q.k by the key scale is scaling the scores; p.v by the value scale, the output
        softmax_scale_log2 = softmax_scale_log2 * tl.load(kv_scales_ptr)
        value_scale = tl.load(kv_scales_ptr + 1)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * block_tables_stride_seq
    if HAS_SLIDING_WINDOW:
        acc, row_max, row_sum = _attend_to_key_range(
            acc, row_max, row_sum, query, query_pos, key_start, all_start,
            key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
            block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
            key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
            value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
            MASK_BY_QUERY_POSITION=True, HAS_SLIDING_WINDOW=True,
            HAS_SOFT_CAP=HAS_SOFT_CAP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_IN_FP32=DOT_IN_FP32, USE_DOT=True,
        LAZY_RESCALE=LAZY_RESCALE,
        )
    acc, row_max, row_sum = _attend_to_key_range(
        acc, row_max, row_sum, query, query_pos, all_start, all_end,
        key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
        block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
        key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
        value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
        MASK_BY_QUERY_POSITION=False, HAS_SLIDING_WINDOW=False,
        HAS_SOFT_CAP=HAS_SOFT_CAP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_IN_FP32=DOT_IN_FP32, USE_DOT=True,
        LAZY_RESCALE=LAZY_RESCALE,
    )
    acc, row_max, row_sum = _attend_to_key_range(
        acc, row_max, row_sum, query, query_pos, all_end, key_end,
        key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
        block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
        key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
        value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
        MASK_BY_QUERY_POSITION=True, HAS_SLIDING_WINDOW=HAS_SLIDING_WINDOW,
        HAS_SOFT_CAP=HAS_SOFT_CAP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_IN_FP32=DOT_IN_FP32, USE_DOT=True,
        LAZY_RESCALE=LAZY_RESCALE,
    )
    out = acc * (value_scale / tl.where(row_sum == 0.0, 1.0, row_sum))[:, None]
    tl.store(
        out_ptr + token[:, None] * out_stride_token + head[:, None] * out_stride_head + dims[None, :] * out_stride_dim,
        out.to(out_ptr.dtype.element_ty), mask=row_mask,
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of variable-length queries over a paged KV cache; see ``reference.paged_attention``.

    Batches with a query of more than one token (prefill, extend, or decode mixed with them) run
    the tiled prefill kernel; decode-only batches run the split-K decode kernel (below) and its reduce. Neither path reads query lengths on the host. An fp8 cache
    (``torch.float8_e4m3fn``) is read with its ``kv_scales`` ``[2]`` (key scale, value scale).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"key_cache and value_cache must be [blocks, block_size, Hkv, {head_dim}] for queries of head_dim "
            f"{head_dim}; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    reference.check_soft_cap(soft_cap)
    reference.check_kv_scales(key_cache, kv_scales)

    out = query.new_empty(num_tokens, num_heads, head_dim)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_queries_per_kv = num_heads // num_kv_heads
    common = dict(
        num_queries_per_kv=num_queries_per_kv,
        block_size=block_size,
        head_dim=head_dim,
        softmax_scale_log2=scale * LOG2_E,
        soft_cap_log2=(soft_cap or 1.0) * LOG2_E,
        sliding_window=sliding_window or 0,
        HAS_SLIDING_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=soft_cap is not None,
        BLOCK_D=next_power_of_2(max(head_dim, 16)),
        # fp32 inputs need an exact fp32 dot, not tf32, to agree with the reference to 1e-5. On CPU
        # tensors (the Triton interpreter) bf16 goes through fp32 as well: the interpreter
        # multiplies bf16 dot operands as their raw 16-bit patterns.
        DOT_IN_FP32=query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and query.device.type == "cpu"),
    )
    if max_query_len == 1:
        decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                         max_context_len, kv_scales, common)
    else:
        block_m, block_n = _prefill_tiles(common["BLOCK_D"], query.dtype)
        group_size = next_power_of_2(num_queries_per_kv)
        block_q = max(1, block_m // group_size)
        grid = (num_tokens // block_q + num_seqs, num_kv_heads)
        _prefill_attention_kernel[grid](
            out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
            kv_scales if kv_scales is not None else out, num_seqs,
            *out.stride(), *query.stride(), block_tables.stride(0), *key_cache.stride(), *value_cache.stride(),
            BLOCK_Q=block_q, GROUP_SIZE=group_size, BLOCK_N=block_n,
            HAS_KV_SCALES=kv_scales is not None, FP8_DOT_IN_FP16=fp8_dot_in_fp16(query, key_cache),
            LAZY_RESCALE=PREFILL_LAZY_RESCALE, num_warps=PREFILL_NUM_WARPS, num_stages=PREFILL_NUM_STAGES, **common,
        )
    return out


# ------------------------------------------------------------------------------------------
# Decode (one query token per sequence)
# ------------------------------------------------------------------------------------------
# Triton: decode attention (one query token per sequence) over the paged KV cache, split-K with
# the split chosen per sequence on the device; see ``reference.py``.
#
# One program attends one split of one sequence's keys for all the query heads of one KV head (GQA),
# so every key and value tile is read once for its whole group. A batch has ``num_splits`` splits
# per (sequence, KV head), chosen on the host from the batch size and the SM count only; each
# sequence then cuts its own context into at most that many pieces of at least
# ``min_split_tokens`` keys. That keeps a CUDA graph (captured for the longest context) honest
# about the real lengths: a 300-token sequence runs one program, an 8k one runs ``num_splits``.
# Sequences cut into more than one piece write partial softmaxes that a small reduce kernel merges;
# the others write their output directly and the reduce skips them.
#
# An fp8 cache is read as stored and its per-layer scales are folded into the softmax scale (keys)
# and the output (values), so the tiles need no per-element multiply.


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """How decode attention is launched (the defaults were picked on an H200, head_dim 128, bf16:
    64-key tiles, 4 warps, 3 stages ran 256 sequences of U[200,2048] keys at 3.68 TB/s in CUDA
    graphs (Qwen3-0.6B shape; 2 stages 3.48, the old kernel 2.81-3.00); 128-key tiles, 8 warps or
    the no-dot form were slower; 32 splits of 256 keys keep one 8k sequence on 256 programs).
    Caches of 4-byte elements run 2 stages (the 3-stage tiles were measured in bf16 only).

    ``programs_per_sm``: the split count aims at this many programs per SM over the batch;
    ``max_splits``: its cap (a power of two); ``min_split_tokens``: no piece of a context is shorter.
    ``use_dot``: scores and outputs by ``tl.dot`` (the group's heads padded to 16 rows), else by
    broadcast multiply-and-sum over the group's real heads only. ``fused_reduce``: the last piece of
    each split context merges the pieces (a counter per layer cache), no reduce kernel (H200, graphs
    for 4,096 keys: 0.6B shape 256 x U[200,2048] 353.7 -> 324.7 us, 8B 32 x 8k 317.0 -> 292.5,
    bs1 over 100 keys 7.4 -> 5.8, 64 x U[200,2048] and bs1 over 2k keys even). ``fp8_dot_in_fp16``: with an fp8
    cache and bf16 queries, dot in fp16 (see ``_as_fp16``). ``fp8_block_n``: the key tile for 1-byte (fp8)
    caches, None for ``block_n`` (H200, 2026-12-02, fp8 cache, 4 warps, 3 stages, us per layer call against
    the bf16 cache's default: Llama-3-8B shape 256 x U[200,2048] 342.1 with 128-key tiles vs 389.8 with 64
    (bf16 355.3), 32 x 8k 284.7 vs 331.6 (bf16 318.4), Qwen3-0.6B shape 256 x U[200,2048] 327.7 vs 377.6
    (bf16 346.0): a 128-key fp8 tile is the bf16 64-key tile's bytes). Without a register cap; under
    ``maxnreg`` 128 the 64-key fp8 tile is the faster one (see ``DEFAULT_LAUNCH``).
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 8
    max_splits: int = 32
    min_split_tokens: int = 256
    use_dot: bool = True
    fp8_dot_in_fp16: bool = True
    fused_reduce: bool = True
    # Programmatic dependent launch where the batch-1 GEMVs use it (``kernels/gemv``): the kernel
    # starts while the one before it (the attention inputs) finishes and lets ``o_proj``'s GEMV
    # start early in turn; every program waits for the previous kernel before it reads anything.
    use_pdl: bool = True
    fp8_block_n: int | None = None
    # Register cap (Triton's ``maxnreg``) for 1- and 2-byte caches on CUDA with heads of at most 128,
    # None for the compiler's choice: registers, not shared memory, bound the programs per SM (ncu, H200,
    # 8B shape 256 x U[200,2048]: bf16 144 registers, 3 programs per SM, 3.70 TB/s; fp8 with 128-key tiles
    # 248, 2 per SM, 1.81 TB/s). Under 128, spills cost more than the occupancy gives (112: 0.91x).
    maxnreg: int | None = None
    # Programs ordered KV head fastest (grid (KV heads, sequences, splits)), so the heads of one cache
    # block are read by programs running side by side.
    heads_fastest: bool = False


# H200, 2026-12-03, us per layer call in CUDA graphs (attention_kernels' cases; its sweep times
# PREVIOUS_LAUNCH beside this one), the launch before -> this one: bf16 cache 8B shape 256 x U[200,2048] 351.7 -> 328.4 (1.07x), 32 x 8k
# 318.9 -> 266.1 (1.20x), 0.6B shape 256 x U[200,2048] 349.8 -> 324.9 (1.08x); fp8 cache (64-key tiles,
# 128 registers, was 128-key tiles at 248) 351.7 -> 296.8 (1.19x), 290.8 -> 237.3 (1.23x), 351.5 -> 295.7
# (1.19x). An fp8 cache stays at ~2.1 TB/s of its bytes: with the [blocks, slots, KV heads, dim] layout a
# key of one head is a 128-byte run 1 KiB from the next, and a kernel that only loads the tiles reaches
# ~2.2 TB/s on it.
DEFAULT_LAUNCH = DecodeLaunch(maxnreg=128, heads_fastest=True)
PREVIOUS_LAUNCH = DecodeLaunch(fp8_block_n=128)
# The shortest piece of a split context (tests build contexts around it).
DECODE_MIN_PARTITION_SIZE = DEFAULT_LAUNCH.min_split_tokens
_SM_COUNTS: dict[int, int] = {}
# Where there is no CUDA device (the Triton interpreter): an H200's count.
_FALLBACK_SM_COUNT = 132


@triton.jit
def _used_splits(context_len, first_key, num_splits, BLOCK_N: tl.constexpr, min_split_tiles):
    """Pieces this sequence's keys are cut into, and the tiles each piece takes."""
    num_tiles = tl.maximum(tl.cdiv(context_len - first_key, BLOCK_N), 1)
    used = tl.maximum(tl.minimum(tl.cdiv(num_tiles, min_split_tiles), num_splits), 1)
    tiles_per_split = tl.cdiv(num_tiles, used)
    # Recounted so no piece starts past the context (19 tiles in 8 pieces: 7 of 3 tiles).
    return tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1), tiles_per_split


@triton.jit
def _merge_pieces(out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, counter_ptr, out_offsets, out_stride_dim,
                  stat_bases, used, is_real_row, row_mask, dims, BLOCK_S: tl.constexpr):
    """Called by every piece of one (sequence, KV head) after storing its partial softmax: the
    piece that finishes last (its ticket is ``used - 1``) merges all of them, as the reduce kernel
    does, and puts the counter back to 0 for the next launch. The barrier and the acq_rel ticket
    make every piece's partials visible to the merging one; it reads them from L2 (``.cg``)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if ticket == used - 1:
        splits = tl.arange(0, BLOCK_S)
        stat_mask = is_real_row[:, None] & (splits < used)[None, :]
        stats = stat_bases[:, None] + splits[None, :]
        maxes = tl.load(partial_max_ptr + stats, mask=stat_mask, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(partial_sum_ptr + stats, mask=stat_mask, other=0.0, cache_modifier=".cg")
        global_max = tl.max(maxes, 1)
        global_max = tl.where(global_max == float("-inf"), 0.0, global_max)  # padding rows: no pieces
        weights = tl.where(stat_mask, sums * tl.exp2(maxes - global_max[:, None]), 0.0)
        total = tl.sum(weights, 1)
        merged = tl.zeros([stat_bases.shape[0], dims.shape[0]], dtype=tl.float32)
        for piece in range(0, used):
            piece_out = tl.load(partial_out_ptr + (stat_bases + piece)[:, None] * dims.shape[0] + dims[None, :],
                                mask=row_mask, other=0.0, cache_modifier=".cg")
            piece_weight = tl.sum(tl.where(splits[None, :] == piece, weights, 0.0), 1)
            merged += piece_out * piece_weight[:, None]
        merged = merged / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + out_offsets[:, None] + dims[None, :] * out_stride_dim,
                 merged.to(out_ptr.dtype.element_ty), mask=row_mask)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")


# The split count and the minimum piece change with the batch and the launch: specializing on them
# (== 1) would compile a second variant of each kernel.
@triton.jit(do_not_specialize=["num_splits", "min_split_tiles"])
def _split_decode_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, counters_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    kv_scales_ptr,
    num_heads,
    out_stride_token, out_stride_head, out_stride_dim,
    query_stride_token, query_stride_head, query_stride_dim,
    block_tables_stride_seq,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
    num_queries_per_kv, block_size: tl.constexpr, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
    num_splits, min_split_tiles,
    HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_KV_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, USE_DOT: tl.constexpr, FP8_DOT_IN_FP16: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = False,
    HEADS_FASTEST: tl.constexpr = False,
):
    """One program: one piece of one sequence's keys, for the query heads of one KV head. With
    FUSED_REDUCE the last piece of a (sequence, KV head) to finish merges all of them (see
    ``_merge_pieces``), so no reduce kernel runs. ``USE_PDL``: every program reads its step inputs
    (query bounds, context length: written before the step, by no kernel of it), then waits for the
    kernel before it, before it returns or reads anything else (so the kernel after it, waiting on
    this one, waits on that one too)."""
    if HEADS_FASTEST:  # grid (KV heads, sequences, splits): one sequence's heads run side by side
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    split = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    context_len = tl.load(context_lens_ptr + seq)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if query_len != 1:  # an empty (padding) sequence
        return
    first_key = 0
    if HAS_SLIDING_WINDOW:
        first_key = tl.maximum(context_len - sliding_window, 0)
    used, tiles_per_split = _used_splits(context_len, first_key, num_splits, BLOCK_N, min_split_tiles)
    if split >= used:
        return
    key_start = first_key + split * tiles_per_split * BLOCK_N
    key_end = tl.minimum(key_start + tiles_per_split * BLOCK_N, context_len)

    rows = tl.arange(0, BLOCK_M)
    is_real_row = rows < num_queries_per_kv
    head = kv_head * num_queries_per_kv + rows
    dims = tl.arange(0, BLOCK_D)
    row_mask = is_real_row[:, None] & (dims[None, :] < head_dim)
    token = query_start.to(tl.int64)
    query = tl.load(
        query_ptr + token * query_stride_token + head[:, None] * query_stride_head + dims[None, :] * query_stride_dim,
        mask=row_mask, other=0.0,
    )
    if FP8_DOT_IN_FP16:
        query = _as_fp16(query)
    score_scale = softmax_scale_log2
    value_scale = 1.0
    if HAS_KV_SCALES:  # dequantizing q.k by the key scale is scaling the scores; p.v by the value scale, the output
        score_scale = softmax_scale_log2 * tl.load(kv_scales_ptr)
        value_scale = tl.load(kv_scales_ptr + 1)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    # The single query sits at the last position, so [key_start, key_end) is exactly what it may see.
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * block_tables_stride_seq
    if not USE_DOT:
        query = query.to(tl.float32)
    acc, row_max, row_sum = _attend_to_key_range(
        acc, row_max, row_sum, query, rows, key_start, key_end,
        key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
        block_size, head_dim, score_scale, soft_cap_log2, sliding_window,
        key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
        value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
        MASK_BY_QUERY_POSITION=False, HAS_SLIDING_WINDOW=False,
        HAS_SOFT_CAP=HAS_SOFT_CAP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_IN_FP32=DOT_IN_FP32, USE_DOT=USE_DOT,
        LAZY_RESCALE=False,
    )
    out = acc * (value_scale / tl.where(row_sum == 0.0, 1.0, row_sum))[:, None]
    if used > 1:
        stat_index = (seq.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(partial_max_ptr + stat_index, row_max, mask=is_real_row)
        tl.store(partial_sum_ptr + stat_index, row_sum, mask=is_real_row)
        tl.store(partial_out_ptr + stat_index[:, None] * BLOCK_D + dims[None, :], out, mask=row_mask)
        if FUSED_REDUCE:
            _merge_pieces(out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
                          counters_ptr + seq.to(tl.int64) * num_kv_heads + kv_head,
                          token * out_stride_token + head * out_stride_head, out_stride_dim,
                          (seq.to(tl.int64) * num_heads + head) * num_splits, used, is_real_row, row_mask, dims,
                          BLOCK_S=BLOCK_S)
    else:
        tl.store(
            out_ptr + token * out_stride_token + head[:, None] * out_stride_head + dims[None, :] * out_stride_dim,
            out.to(out_ptr.dtype.element_ty), mask=row_mask,
        )


@triton.jit(do_not_specialize=["num_splits", "min_split_tiles"])
def _split_decode_reduce_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, context_lens_ptr, query_start_loc_ptr,
    num_heads, head_dim, sliding_window, num_splits, min_split_tiles,
    out_stride_token, out_stride_head, out_stride_dim,
    HAS_SLIDING_WINDOW: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merges one (sequence, head)'s pieces, each weighted by sum * 2^(max - global max); a
    sequence of one piece was written by the attention kernel and is skipped."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if query_len != 1:
        return
    context_len = tl.load(context_lens_ptr + seq)
    first_key = 0
    if HAS_SLIDING_WINDOW:
        first_key = tl.maximum(context_len - sliding_window, 0)
    used, _ = _used_splits(context_len, first_key, num_splits, BLOCK_N, min_split_tiles)
    if used == 1:
        return
    splits = tl.arange(0, BLOCK_S)
    is_used = splits < used  # later pieces hold stale memory
    stat_base = (seq.to(tl.int64) * num_heads + head) * num_splits
    maxes = tl.load(partial_max_ptr + stat_base + splits, mask=is_used, other=float("-inf"))
    sums = tl.load(partial_sum_ptr + stat_base + splits, mask=is_used, other=0.0)
    global_max = tl.max(maxes, 0)
    weights = tl.where(is_used, sums * tl.exp2(maxes - global_max), 0.0)
    dims = tl.arange(0, BLOCK_D)
    outs = tl.load(partial_out_ptr + (stat_base + splits)[:, None] * BLOCK_D + dims[None, :],
                   mask=is_used[:, None], other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(outs * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + query_start.to(tl.int64) * out_stride_token + head * out_stride_head + dims * out_stride_dim,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def _prefill_tiles(block_d: int, dtype: torch.dtype) -> tuple[int, int]:
    """(rows, keys) of a prefill program's tiles (module globals read per call, so a benchmark may set them)."""
    if block_d > 128:
        return PREFILL_WIDE_BLOCK_M, PREFILL_WIDE_BLOCK_N
    if dtype == torch.float32:
        return PREFILL_FP32_BLOCK_M, PREFILL_FP32_BLOCK_N
    return PREFILL_BLOCK_M, PREFILL_BLOCK_N


def fp8_dot_in_fp16(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernels dot in fp16: an fp8 cache read by bf16 queries on a GPU (the interpreter
    keeps its fp32 dots)."""
    return key_cache.dtype == torch.float8_e4m3fn and query.dtype == torch.bfloat16 and query.is_cuda


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      launch: DecodeLaunch | None = None) -> int:
    """Splits per (sequence, KV head): enough for ``launch.programs_per_sm`` programs per SM, a
    power of two up to ``launch.max_splits``, and no more than the longest context can use."""
    launch = launch or DEFAULT_LAUNCH
    wanted = triton.cdiv(launch.programs_per_sm * _sm_count(device), max(1, num_seqs * num_kv_heads))
    usable = triton.cdiv(max(1, max_context_len), launch.min_split_tokens)
    return min(next_power_of_2(min(wanted, usable)), launch.max_splits)


# Per layer cache (its data pointer): one int32 counter per (sequence, KV head) for the fused merge.
# Each launch leaves them all 0 again, so they are zeroed once, when made, and never in a CUDA graph:
# the eager warm-up before each capture (largest batch first) makes them big enough. Replaced
# buffers stay referenced, as graphs captured earlier still use them.
_MERGE_COUNTERS: dict[tuple[int, torch.device], torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []


def _merge_counters(key_cache: torch.Tensor, count: int) -> torch.Tensor:
    key = (key_cache.data_ptr(), key_cache.device)
    counters = _MERGE_COUNTERS.get(key)
    if counters is None or counters.numel() < count:
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = torch.zeros(max(count, 512 * 8), dtype=torch.int32, device=key_cache.device)
        _MERGE_COUNTERS[key] = counters
    return counters


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _FALLBACK_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                     max_context_len, kv_scales, common, launch: DecodeLaunch | None = None) -> None:
    """Writes decode attention into ``out``; ``common`` holds the kernel arguments
    :func:`paged_attention` shares with its prefill kernel. ``launch``: ``DEFAULT_LAUNCH`` when None."""
    launch = launch or DEFAULT_LAUNCH
    num_heads = query.shape[1]
    num_seqs, num_kv_heads = context_lens.shape[0], key_cache.shape[2]
    sliding_window = common["sliding_window"] if common["HAS_SLIDING_WINDOW"] else None
    longest_span = max_context_len if sliding_window is None else min(max_context_len, sliding_window)
    block_d = common["BLOCK_D"]
    # D > 128 halves the key tile so the fp32 accumulator and the tiles stay in registers.
    tile = launch.fp8_block_n if launch.fp8_block_n and key_cache.element_size() == 1 else launch.block_n
    block_n = tile // (2 if block_d > 128 else 1)
    min_split_tiles = max(1, launch.min_split_tokens // block_n)
    num_splits = num_decode_splits(num_seqs, num_kv_heads, longest_span, query.device, launch)
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device)
        partial_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:  # never written: every sequence is one piece
        partial_out = partial_max = partial_sum = out
    fused_reduce = launch.fused_reduce and num_splits > 1
    counters = _merge_counters(key_cache, num_seqs * num_kv_heads) if fused_reduce else out
    grid = (num_kv_heads, num_seqs, num_splits) if launch.heads_fastest else (num_seqs, num_kv_heads, num_splits)
    _split_decode_kernel[grid](
        out, partial_out, partial_max, partial_sum, counters,
        query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
        kv_scales if kv_scales is not None else out,
        num_heads,
        *out.stride(), *query.stride(), block_tables.stride(0), *key_cache.stride(), *value_cache.stride(),
        num_splits=num_splits, min_split_tiles=min_split_tiles, HAS_KV_SCALES=kv_scales is not None,
        # tl.dot needs at least 16 rows; the heads of one group are padded up to that.
        BLOCK_M=next_power_of_2(common["num_queries_per_kv"]) if not launch.use_dot
        else max(16, next_power_of_2(common["num_queries_per_kv"])),
        BLOCK_N=block_n, USE_DOT=launch.use_dot,
        FP8_DOT_IN_FP16=launch.fp8_dot_in_fp16 and fp8_dot_in_fp16(query, key_cache),
        FUSED_REDUCE=fused_reduce, BLOCK_S=next_power_of_2(launch.max_splits), HEADS_FASTEST=launch.heads_fastest,
        num_warps=launch.num_warps, num_stages=launch.num_stages if key_cache.element_size() <= 2 else 2,
        **_register_cap(launch, key_cache, block_d), **_pdl_launch(query, launch.use_pdl), **common,
    )
    if num_splits > 1 and not fused_reduce:
        _split_decode_reduce_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_max, partial_sum, context_lens, query_start_loc,
            num_heads, common["head_dim"], common["sliding_window"], num_splits, min_split_tiles,
            *out.stride(), HAS_SLIDING_WINDOW=common["HAS_SLIDING_WINDOW"],
            BLOCK_S=next_power_of_2(launch.max_splits),
            BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4,
        )


def _register_cap(launch: DecodeLaunch, key_cache: torch.Tensor, block_d: int) -> dict:
    """Triton's ``maxnreg`` where the launch caps registers and this cache is one it was measured on: CUDA, 1- or 2-byte
    elements, heads of at most 128 (the caps were measured there only)."""
    if not launch.maxnreg or not key_cache.is_cuda or block_d > 128 or key_cache.element_size() > 2:
        return {}
    return {"maxnreg": launch.maxnreg}


def _pdl_launch(query: torch.Tensor, wanted: bool) -> dict:
    """Programmatic dependent launch where the batch-1 GEMVs use it (``kernels/gemv``), when wanted."""
    from ..gemv.triton_gemv import uses_pdl

    return {"USE_PDL": True, "launch_pdl": True} if wanted and uses_pdl(query) else {}
