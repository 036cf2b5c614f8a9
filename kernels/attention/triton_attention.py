"""Triton: causal attention over the paged KV cache (tiled prefill, split-K decode); see ``reference.py``.

Launch shapes were measured on an H200; every kernel accepts any strides and dtypes the reference
does, and all arithmetic is fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import LOG2_E, next_power_of_2
from . import reference
from .triton_decode import decode_attention
from .triton_tiles import _attend_to_key_range

# Launch shapes, measured on an H200 with head_dim 128 (bf16): a prefill program takes
# PREFILL_BLOCK_M rows of (query token, head of the GQA group) and walks keys PREFILL_BLOCK_N at a time.
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 32
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 2
# Decode splits each sequence's keys into partitions (flash-decoding), so a handful of long
# sequences still fill the GPU; a second kernel merges the partial softmaxes. It splits only as
# far as it takes to reach about DECODE_TARGET_PROGRAMS programs (some 8 per SM), since every
# partition adds partial results to write and merge: a batch of 128 sequences of 8 KV heads
# runs unsplit. (On an H200 with the Qwen3-0.6B shape, targets of 4096 and 16384 were no faster
# than 2048, which still merged two partitions, one of them empty, at 200 sequences.)
DECODE_TARGET_PROGRAMS = 1024
DECODE_MIN_PARTITION_SIZE = 256
DECODE_BLOCK_N = 64
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2



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
    num_queries_per_kv, block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
    HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_KV_SCALES: tl.constexpr,
    BLOCK_Q: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
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
            HAS_SOFT_CAP=HAS_SOFT_CAP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_IN_FP32=DOT_IN_FP32,
        )
    acc, row_max, row_sum = _attend_to_key_range(
        acc, row_max, row_sum, query, query_pos, all_start, all_end,
        key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
        block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
        key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
        value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
        MASK_BY_QUERY_POSITION=False, HAS_SLIDING_WINDOW=False,
        HAS_SOFT_CAP=HAS_SOFT_CAP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_IN_FP32=DOT_IN_FP32,
    )
    acc, row_max, row_sum = _attend_to_key_range(
        acc, row_max, row_sum, query, query_pos, all_end, key_end,
        key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
        block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
        key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
        value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
        MASK_BY_QUERY_POSITION=True, HAS_SLIDING_WINDOW=HAS_SLIDING_WINDOW,
        HAS_SOFT_CAP=HAS_SOFT_CAP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_IN_FP32=DOT_IN_FP32,
    )
    out = acc * (value_scale / tl.where(row_sum == 0.0, 1.0, row_sum))[:, None]
    tl.store(
        out_ptr + token[:, None] * out_stride_token + head[:, None] * out_stride_head + dims[None, :] * out_stride_dim,
        out.to(out_ptr.dtype.element_ty), mask=row_mask,
    )


@triton.jit
def _decode_attention_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    num_heads, num_partitions,
    out_stride_token, out_stride_head, out_stride_dim,
    query_stride_token, query_stride_head, query_stride_dim,
    block_tables_stride_seq,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
    num_queries_per_kv, block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
    partition_size,
    HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, IS_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """One program: one partition of one sequence's keys, for the query heads of one KV head.

    With IS_SPLIT it writes the partition's normalized output and its softmax max and sum for
    the reduce kernel; otherwise (one partition covers every context) the final output.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if query_len != 1:  # an empty (padding) sequence
        return
    context_len = tl.load(context_lens_ptr + seq)
    first_key = 0
    if HAS_SLIDING_WINDOW:
        first_key = tl.maximum(context_len - sliding_window, 0)
    # Partitions count from the window's first key, so a window needs no more of them than it spans.
    key_start = first_key + partition * partition_size
    key_end = tl.minimum(key_start + partition_size, context_len)
    if IS_SPLIT:
        if key_start >= context_len:
            return

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
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    # The single query sits at the last position, so [key_start, key_end) is exactly what it may see.
    acc, row_max, row_sum = _attend_to_key_range(
        acc, row_max, row_sum, query, rows, key_start, key_end,
        key_cache_ptr, value_cache_ptr, block_tables_ptr + seq.to(tl.int64) * block_tables_stride_seq, kv_head,
        block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
        key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
        value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
        MASK_BY_QUERY_POSITION=False, HAS_SLIDING_WINDOW=False,
        HAS_SOFT_CAP=HAS_SOFT_CAP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_IN_FP32=DOT_IN_FP32,
    )
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    if IS_SPLIT:
        stat_index = (seq.to(tl.int64) * num_heads + head) * num_partitions + partition
        tl.store(partial_max_ptr + stat_index, row_max, mask=is_real_row)
        tl.store(partial_sum_ptr + stat_index, row_sum, mask=is_real_row)
        tl.store(partial_out_ptr + stat_index[:, None] * BLOCK_D + dims[None, :], out, mask=row_mask)
    else:
        tl.store(
            out_ptr + token * out_stride_token + head[:, None] * out_stride_head + dims[None, :] * out_stride_dim,
            out.to(out_ptr.dtype.element_ty), mask=row_mask,
        )


@triton.jit
def _decode_reduce_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, context_lens_ptr, query_start_loc_ptr,
    num_heads, num_partitions, partition_size, head_dim, sliding_window,
    out_stride_token, out_stride_head, out_stride_dim,
    HAS_SLIDING_WINDOW: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merges one (sequence, head)'s partition outputs: each weighs sum * 2^(max - global max)."""
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
    # Only these partitions were written; later ones hold stale memory.
    num_used_partitions = tl.cdiv(context_len - first_key, partition_size)
    stat_base = (seq.to(tl.int64) * num_heads + head) * num_partitions

    running_max = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    for first in range(0, num_used_partitions, BLOCK_P):
        partitions = first + tl.arange(0, BLOCK_P)
        maxes = tl.load(partial_max_ptr + stat_base + partitions, mask=partitions < num_used_partitions,
                        other=float("-inf"))
        running_max = tl.maximum(running_max, maxes)
    global_max = tl.max(running_max, 0)

    dims = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_P], dtype=tl.float32)
    for first in range(0, num_used_partitions, BLOCK_P):
        partitions = first + tl.arange(0, BLOCK_P)
        is_used = partitions < num_used_partitions
        maxes = tl.load(partial_max_ptr + stat_base + partitions, mask=is_used, other=float("-inf"))
        sums = tl.load(partial_sum_ptr + stat_base + partitions, mask=is_used, other=0.0)
        weights = tl.where(is_used, sums * tl.exp2(maxes - global_max), 0.0)
        outs = tl.load(partial_out_ptr + (stat_base + partitions)[:, None] * BLOCK_D + dims[None, :],
                       mask=is_used[:, None], other=0.0)
        acc += tl.sum(outs * weights[:, None], 0)
        total += weights
    total_sum = tl.sum(total, 0)
    out = acc / tl.where(total_sum == 0.0, 1.0, total_sum)
    tl.store(out_ptr + query_start.to(tl.int64) * out_stride_token + head * out_stride_head + dims * out_stride_dim,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


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
    the tiled prefill kernel; decode-only batches run the split-K decode kernel of
    ``triton_decode.py`` and its reduce. Neither path reads query lengths on the host. An fp8 cache
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
    # D > 128 halves the key tile so the fp32 accumulator and the tiles stay in registers.
    halve_for_wide_heads = 2 if common["BLOCK_D"] > 128 else 1
    if max_query_len == 1:
        decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                         max_context_len, kv_scales, common)
    else:
        group_size = next_power_of_2(num_queries_per_kv)
        block_q = max(1, PREFILL_BLOCK_M // group_size)
        grid = (num_tokens // block_q + num_seqs, num_kv_heads)
        _prefill_attention_kernel[grid](
            out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
            kv_scales if kv_scales is not None else out, num_seqs,
            *out.stride(), *query.stride(), block_tables.stride(0), *key_cache.stride(), *value_cache.stride(),
            BLOCK_Q=block_q, GROUP_SIZE=group_size, BLOCK_N=PREFILL_BLOCK_N // halve_for_wide_heads,
            HAS_KV_SCALES=kv_scales is not None,
            num_warps=PREFILL_NUM_WARPS, num_stages=PREFILL_NUM_STAGES, **common,
        )
    return out


def _decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                      max_context_len, sliding_window, block_n, common):
    num_heads = query.shape[1]
    num_seqs, num_kv_heads = context_lens.shape[0], key_cache.shape[2]
    longest_span = max_context_len if sliding_window is None else min(max_context_len, sliding_window)
    partition_size = _decode_partition_size(num_seqs, num_kv_heads, longest_span)
    num_partitions = max(1, triton.cdiv(longest_span, partition_size))
    is_split = num_partitions > 1
    block_d = common["BLOCK_D"]
    if is_split:
        partial_out = torch.empty(num_seqs, num_heads, num_partitions, block_d, dtype=torch.float32,
                                  device=query.device)
        partial_max = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:  # never read: the kernel writes the output directly
        partial_out = partial_max = partial_sum = out
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, partial_out, partial_max, partial_sum,
        query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
        num_heads, num_partitions,
        *out.stride(), *query.stride(), block_tables.stride(0), *key_cache.stride(), *value_cache.stride(),
        partition_size=partition_size, IS_SPLIT=is_split,
        # tl.dot needs at least 16 rows; the heads of one group are padded up to that.
        BLOCK_M=max(16, next_power_of_2(common["num_queries_per_kv"])), BLOCK_N=block_n,
        num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES, **common,
    )
    if is_split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_max, partial_sum, context_lens, query_start_loc,
            num_heads, num_partitions, partition_size, common["head_dim"], common["sliding_window"],
            *out.stride(), HAS_SLIDING_WINDOW=common["HAS_SLIDING_WINDOW"],
            BLOCK_P=16, BLOCK_D=block_d, num_warps=4,
        )


def _decode_partition_size(num_seqs: int, num_kv_heads: int, longest_span: int) -> int:
    """Keys per decode partition: a power of two (few distinct values), at least
    DECODE_MIN_PARTITION_SIZE, and small enough for about DECODE_TARGET_PROGRAMS programs."""
    num_partitions_wanted = triton.cdiv(DECODE_TARGET_PROGRAMS, num_seqs * num_kv_heads)
    return max(DECODE_MIN_PARTITION_SIZE, next_power_of_2(triton.cdiv(longest_span, num_partitions_wanted)))
