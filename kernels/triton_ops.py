"""Triton kernels for CUDA tensors, each with the signature and semantics of its torch reference.

The references live in ``kernels/reference.py`` (and ``kernels/sampling.py`` for the sampler);
``kernels/__init__.py`` calls the function of the same name here when its input is on CUDA.
Every kernel accepts any strides and dtypes the reference does; all arithmetic is fp32.

Importing this module needs Triton but no GPU, so CI can import it and the tests can run the
kernels on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` before import).

>>> from hearth_llm.kernels import triton_ops
>>> triton_ops.silu_and_mul(torch.randn(4, 256, device="cuda")).shape
torch.Size([4, 128])
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference, sampling

__all__ = [
    "write_kv_cache",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu",
    "layer_norm",
    "qk_norm_rope_and_cache",
    "sample_from_logits",
]

_LOG2_E = 1.4426950408889634

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


def _next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def _tanh(x):
    """tanh from exp (libdevice's tanh has no Triton-interpreter version); exact to float32
    rounding near 1 and +-1 at the extremes (exp overflows to inf, 2 / inf = 0)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


# --------------------------------------------------------------------------------------------
# write_kv_cache
# --------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_kv_heads, head_dim, block_size,
    key_stride_token, key_stride_head, key_stride_dim,
    value_stride_token, value_stride_head, value_stride_dim,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A slot of -1 marks a padding token of a CUDA-graph batch: it owns no cache slot.
    if slot < 0:
        return
    block = slot // block_size
    slot_in_block = slot % block_size

    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims * key_stride_dim, mask=mask)
    value = tl.load(
        value_ptr + token * value_stride_token + heads * value_stride_head + dims * value_stride_dim, mask=mask
    )
    key_dest = (key_cache_ptr + block * key_cache_stride_block + slot_in_block * key_cache_stride_slot
                + heads * key_cache_stride_head + dims * key_cache_stride_dim)
    value_dest = (value_cache_ptr + block * value_cache_stride_block + slot_in_block * value_cache_stride_slot
                  + heads * value_cache_stride_head + dims * value_cache_stride_dim)
    tl.store(key_dest, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_dest, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``[T, Hkv, D]`` keys and values at flat slots of ``[blocks, block_size, Hkv, D]`` caches.

    A slot of -1 skips its token (padding rows of a CUDA-graph batch); the reference has no such rows.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.shape[2:] != (num_kv_heads, head_dim) or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"key_cache and value_cache must be [blocks, block_size, {num_kv_heads}, {head_dim}] to hold keys "
            f"of shape {tuple(key.shape)}; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if num_tokens == 0:
        return
    block_h, block_d = _next_power_of_2(num_kv_heads), _next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        num_kv_heads, head_dim, key_cache.shape[1],
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_warps_for(block_h * block_d),
    )


def _warps_for(num_elements: int) -> int:
    """Enough warps that each thread holds a few vector loads of an elementwise row kernel."""
    return max(1, min(16, num_elements // 1024))


# --------------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------------


@triton.jit
def _attend_to_key_range(
    acc, row_max, row_sum, query, query_pos,
    key_start, key_end,
    key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
    block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
    MASK_BY_QUERY_POSITION: tl.constexpr, HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """Online-softmax accumulation of ``query`` rows over cache positions [key_start, key_end).

    Scores are kept in the log2 domain (scaled by scale * log2(e)) so exp2 replaces exp; a soft
    cap c makes them ``c * tanh(scale * q.k / c)``, with ``soft_cap_log2`` = c * log2(e).
    ``row_max`` starts at -inf; rows that see no key stay at acc = 0, row_sum = 0.
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
        if DOT_IN_FP32:
            scores = tl.dot(query.to(tl.float32), tl.trans(key.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(query, tl.trans(key))
        if HAS_SOFT_CAP:
            scores = _tanh(scores * (softmax_scale_log2 / soft_cap_log2)) * soft_cap_log2
        else:
            scores = scores * softmax_scale_log2

        is_visible = is_key_in_range[None, :]
        if MASK_BY_QUERY_POSITION:
            is_visible = is_visible & (key_pos[None, :] <= query_pos[:, None])
            if HAS_SLIDING_WINDOW:
                is_visible = is_visible & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        scores = tl.where(is_visible, scores, float("-inf"))

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
        if DOT_IN_FP32:
            probs_of_dot_dtype = probs.to(query.dtype).to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(probs_of_dot_dtype, value.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(probs.to(query.dtype), value)
        row_max = new_max
    return acc, row_max, row_sum


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
    num_seqs,
    out_stride_token, out_stride_head, out_stride_dim,
    query_stride_token, query_stride_head, query_stride_dim,
    block_tables_stride_seq,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
    num_queries_per_kv, block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
    HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_IN_FP32: tl.constexpr,
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
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
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
) -> torch.Tensor:
    """Causal attention of variable-length queries over a paged KV cache; see ``reference.paged_attention``.

    Batches with a query of more than one token (prefill, extend, or decode mixed with them) run
    the tiled prefill kernel; decode-only batches run the split-K decode kernel and its reduce.
    Neither path reads query lengths on the host.
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

    out = query.new_empty(num_tokens, num_heads, head_dim)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_queries_per_kv = num_heads // num_kv_heads
    common = dict(
        num_queries_per_kv=num_queries_per_kv,
        block_size=block_size,
        head_dim=head_dim,
        softmax_scale_log2=scale * _LOG2_E,
        soft_cap_log2=(soft_cap or 1.0) * _LOG2_E,
        sliding_window=sliding_window or 0,
        HAS_SLIDING_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=soft_cap is not None,
        BLOCK_D=_next_power_of_2(max(head_dim, 16)),
        # fp32 inputs need an exact fp32 dot, not tf32, to agree with the reference to 1e-5. On CPU
        # tensors (the Triton interpreter) bf16 goes through fp32 as well: the interpreter
        # multiplies bf16 dot operands as their raw 16-bit patterns.
        DOT_IN_FP32=query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and query.device.type == "cpu"),
    )
    # D > 128 halves the key tile so the fp32 accumulator and the tiles stay in registers.
    halve_for_wide_heads = 2 if common["BLOCK_D"] > 128 else 1
    if max_query_len == 1:
        _decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                          max_context_len, sliding_window, DECODE_BLOCK_N // halve_for_wide_heads, common)
    else:
        group_size = _next_power_of_2(num_queries_per_kv)
        block_q = max(1, PREFILL_BLOCK_M // group_size)
        grid = (num_tokens // block_q + num_seqs, num_kv_heads)
        _prefill_attention_kernel[grid](
            out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc, num_seqs,
            *out.stride(), *query.stride(), block_tables.stride(0), *key_cache.stride(), *value_cache.stride(),
            BLOCK_Q=block_q, GROUP_SIZE=group_size, BLOCK_N=PREFILL_BLOCK_N // halve_for_wide_heads,
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
        BLOCK_M=max(16, _next_power_of_2(common["num_queries_per_kv"])), BLOCK_N=block_n,
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
    return max(DECODE_MIN_PARTITION_SIZE, _next_power_of_2(triton.cdiv(longest_span, num_partitions_wanted)))


# --------------------------------------------------------------------------------------------
# rms_norm
# --------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    normed_ptr, summed_ptr, x_ptr, residual_ptr, weight_ptr,
    hidden_size, eps,
    x_stride_row, residual_stride_row, normed_stride_row, summed_stride_row,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride_row + cols, mask=mask, other=0.0)
        # Round the sum to its storage dtype before norming it, as the reference norms the stored sum.
        summed = (x + residual.to(tl.float32)).to(summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * summed_stride_row + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden_size + eps)
    # The reference rounds the normed value to the input dtype before scaling by the weight.
    normed = (x * inverse_rms).to(summed_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * normed_stride_row + cols, (normed * weight).to(normed_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual``; returns ``(normed, x + residual)``, both written by one kernel."""
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight must have shape ({hidden_size},) to norm rows of x {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    rows = x.reshape(-1, hidden_size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    summed_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    normed = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, summed_dtype), device=x.device)
    if residual is None:
        residual_rows, summed = rows, x
        # The kernel reads the summed dtype from this pointer; with no residual it is x's own.
        summed_rows = rows
    else:
        residual_rows = residual.reshape(-1, hidden_size)
        if residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
        summed = torch.empty(x.shape, dtype=summed_dtype, device=x.device)
        summed_rows = summed.view(-1, hidden_size)
    if rows.shape[0] == 0:
        return normed, summed
    block = _next_power_of_2(hidden_size)
    normed_rows = normed.view(-1, hidden_size)
    _rms_norm_kernel[(rows.shape[0],)](
        normed_rows, summed_rows, rows, residual_rows, weight.contiguous(), hidden_size, eps,
        rows.stride(0), residual_rows.stride(0), normed_rows.stride(0), summed_rows.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps_for(block),
    )
    return normed, summed


# --------------------------------------------------------------------------------------------
# rotary_embedding
# --------------------------------------------------------------------------------------------


@triton.jit
def _rotary_embedding_kernel(
    out_ptr, x_ptr, positions_ptr, cos_sin_cache_ptr,
    num_heads, half_dim, head_dim,
    x_stride_token, x_stride_head, x_stride_dim,
    out_stride_token, out_stride_head,
    cache_stride_position,
    IS_NEOX: tl.constexpr, HAS_PASS_THROUGH: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """One program per token. ``half_dim`` is half the rotary width R; dims from R to ``head_dim``
    are copied unchanged (partial rotary)."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    pair_mask = pairs < half_dim
    cos = tl.load(cos_sin_cache_ptr + position * cache_stride_position + pairs, mask=pair_mask).to(tl.float32)
    sin = tl.load(cos_sin_cache_ptr + position * cache_stride_position + half_dim + pairs,
                  mask=pair_mask).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & pair_mask[None, :]
    # NeoX (rotate-half): dims i and i + R/2 form one rotating pair; GPT-J: dims 2i and 2i + 1.
    if IS_NEOX:
        first_dims = pairs[None, :]
        second_dims = first_dims + half_dim
    else:
        first_dims = 2 * pairs[None, :]
        second_dims = first_dims + 1
    row = x_ptr + token * x_stride_token + heads * x_stride_head
    first = tl.load(row + first_dims * x_stride_dim, mask=mask).to(tl.float32)
    second = tl.load(row + second_dims * x_stride_dim, mask=mask).to(tl.float32)
    out_first = first * cos[None, :] - second * sin[None, :]
    out_second = second * cos[None, :] + first * sin[None, :]
    out_row = out_ptr + token * out_stride_token + heads * out_stride_head
    tl.store(out_row + first_dims, out_first.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + second_dims, out_second.to(out_ptr.dtype.element_ty), mask=mask)
    if HAS_PASS_THROUGH:
        pass_dims = 2 * half_dim + tl.arange(0, BLOCK_PASS)[None, :]
        pass_mask = (heads < num_heads) & (pass_dims < head_dim)
        kept = tl.load(row + pass_dims * x_stride_dim, mask=pass_mask)
        tl.store(out_row + pass_dims, kept.to(out_ptr.dtype.element_ty), mask=pass_mask)


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``[T, H, D]`` queries and keys, as new tensors; see
    ``reference.rotary_embedding`` (NeoX or GPT-J pairs, partial rotary when R < D).

    ``cos_sin_cache`` is ``[max_position, R]``: the cosines in the first half, sines in the second.
    """
    head_dim = query.shape[-1]
    if head_dim % 2 != 0 or key.shape[-1] != head_dim:
        raise ValueError(f"rotary_embedding needs an even head_dim shared by query and key; "
                         f"got {query.shape[-1]} and {key.shape[-1]}")
    reference.check_rotary_dim(head_dim, cos_sin_cache.shape[-1])
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    return (_rotate(query, positions, cos_sin_cache, is_neox_style),
            _rotate(key, positions, cos_sin_cache, is_neox_style))


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
            is_neox_style: bool = True) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    rotary_dim = cos_sin_cache.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_h, block_half = _next_power_of_2(num_heads), _next_power_of_2(rotary_dim // 2)
    _rotary_embedding_kernel[(num_tokens,)](
        out, x, positions, cos_sin_cache, num_heads, rotary_dim // 2, head_dim,
        *x.stride(), out.stride(0), out.stride(1), cos_sin_cache.stride(0),
        IS_NEOX=is_neox_style, HAS_PASS_THROUGH=rotary_dim < head_dim,
        BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=_next_power_of_2(head_dim - rotary_dim),
        num_warps=_warps_for(2 * block_h * block_half),
    )
    return out


# --------------------------------------------------------------------------------------------
# qk_norm_rope_and_cache: a layer's attention inputs in one launch
# --------------------------------------------------------------------------------------------


@triton.jit
def _norm_and_rotate_heads(
    first, second, norm_weight_ptr, cos, sin, pairs, pair_mask, half_dim, eps,
    HAS_NORM: tl.constexpr, STORAGE: tl.constexpr,
):
    """RMS-norm each row of ``[heads, D]`` (held as its two halves) and rotate it, rounding to
    the storage dtype where the unfused kernels store their outputs."""
    if HAS_NORM:
        inverse_rms = tl.rsqrt((tl.sum(first * first, 1) + tl.sum(second * second, 1)) / (2 * half_dim) + eps)
        weight_first = tl.load(norm_weight_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)
        weight_second = tl.load(norm_weight_ptr + half_dim + pairs, mask=pair_mask, other=0.0).to(tl.float32)
        first = (first * inverse_rms[:, None]).to(STORAGE).to(tl.float32) * weight_first[None, :]
        second = (second * inverse_rms[:, None]).to(STORAGE).to(tl.float32) * weight_second[None, :]
        first = first.to(STORAGE).to(tl.float32)
        second = second.to(STORAGE).to(tl.float32)
    out_first = first * cos[None, :] - second * sin[None, :]
    out_second = second * cos[None, :] + first * sin[None, :]
    return out_first.to(STORAGE), out_second.to(STORAGE)


@triton.jit
def _qk_norm_rope_and_cache_kernel(
    query_out_ptr, qkv_ptr, positions_ptr, cos_sin_cache_ptr, q_norm_weight_ptr, k_norm_weight_ptr,
    key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_heads, num_kv_heads, half_dim, block_size, eps,
    qkv_stride_token, query_out_stride_token, cache_stride_position,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head,
    HAS_QK_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One program per token: its query heads to ``query_out``, its key and value heads to the cache."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    head_dim = 2 * half_dim
    pairs = tl.arange(0, BLOCK_HALF)
    pair_mask = pairs < half_dim
    cos = tl.load(cos_sin_cache_ptr + position * cache_stride_position + pairs, mask=pair_mask).to(tl.float32)
    sin = tl.load(cos_sin_cache_ptr + position * cache_stride_position + half_dim + pairs,
                  mask=pair_mask).to(tl.float32)
    storage = qkv_ptr.dtype.element_ty
    row = qkv_ptr + token * qkv_stride_token

    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & pair_mask[None, :]
    first = tl.load(row + heads * head_dim + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
    second = tl.load(row + heads * head_dim + half_dim + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
    first, second = _norm_and_rotate_heads(first, second, q_norm_weight_ptr, cos, sin, pairs, pair_mask, half_dim,
                                           eps, HAS_NORM=HAS_QK_NORM, STORAGE=storage)
    out = query_out_ptr + token * query_out_stride_token + heads * head_dim + pairs[None, :]
    tl.store(out, first.to(query_out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + half_dim, second.to(query_out_ptr.dtype.element_ty), mask=mask)

    # A slot of -1 marks a padding token of a CUDA-graph batch: it owns no cache slot.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        slot_in_block = slot % block_size
        kv_heads = tl.arange(0, BLOCK_KV)[:, None]
        kv_mask = (kv_heads < num_kv_heads) & pair_mask[None, :]
        key_row = row + num_heads * head_dim + kv_heads * head_dim + pairs[None, :]
        key_first = tl.load(key_row, mask=kv_mask, other=0.0).to(tl.float32)
        key_second = tl.load(key_row + half_dim, mask=kv_mask, other=0.0).to(tl.float32)
        key_first, key_second = _norm_and_rotate_heads(key_first, key_second, k_norm_weight_ptr, cos, sin, pairs,
                                                       pair_mask, half_dim, eps, HAS_NORM=HAS_QK_NORM, STORAGE=storage)
        key_dest = (key_cache_ptr + block * key_cache_stride_block + slot_in_block * key_cache_stride_slot
                    + kv_heads * key_cache_stride_head + pairs[None, :])
        tl.store(key_dest, key_first.to(key_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(key_dest + half_dim, key_second.to(key_cache_ptr.dtype.element_ty), mask=kv_mask)
        value_row = row + (num_heads + num_kv_heads) * head_dim + kv_heads * head_dim + pairs[None, :]
        value_dest = (value_cache_ptr + block * value_cache_stride_block + slot_in_block * value_cache_stride_slot
                      + kv_heads * value_cache_stride_head + pairs[None, :])
        tl.store(value_dest, tl.load(value_row, mask=kv_mask).to(value_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(value_dest + half_dim, tl.load(value_row + half_dim, mask=kv_mask).to(
            value_cache_ptr.dtype.element_ty), mask=kv_mask)


def supports_fused_rotary(head_dim: int, rotary_dim: int, is_neox_style: bool) -> bool:
    """Whether :func:`qk_norm_rope_and_cache` handles this rotary layout."""
    return is_neox_style and rotary_dim == head_dim


def qk_norm_rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    is_neox_style: bool = True,
) -> torch.Tensor:
    """``kernels.qk_norm_rope_and_cache`` in one launch (the unfused path takes five to seven).

    Full-width NeoX rotary only (``supports_fused_rotary``); ``kernels.qk_norm_rope_and_cache``
    sends partial and GPT-J style rotary to the unfused ops.
    """
    num_tokens = qkv.shape[0]
    head_dim = key_cache.shape[-1]
    if qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"qkv must be [T, ({num_heads} + 2 * {num_kv_heads}) * {head_dim}] with an even head_dim, "
                         f"got {tuple(qkv.shape)}")
    if not supports_fused_rotary(head_dim, cos_sin_cache.shape[-1], is_neox_style):
        raise ValueError(f"the fused kernel rotates whole heads NeoX style: cos_sin_cache must be [max_position, "
                         f"{head_dim}] and is_neox_style True; got width {cos_sin_cache.shape[-1]} and "
                         f"is_neox_style={is_neox_style}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must be given together")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache must be contiguous in their last dimension")
    query = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return query
    has_norm = q_norm_weight is not None
    block_h, block_half = _next_power_of_2(num_heads), _next_power_of_2(head_dim // 2)
    _qk_norm_rope_and_cache_kernel[(num_tokens,)](
        query, qkv, positions, cos_sin_cache,
        q_norm_weight.contiguous() if has_norm else qkv, k_norm_weight.contiguous() if has_norm else qkv,
        key_cache, value_cache, slot_mapping,
        num_heads, num_kv_heads, head_dim // 2, key_cache.shape[1], eps,
        qkv.stride(0), query.stride(0), cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HAS_QK_NORM=has_norm, BLOCK_H=block_h, BLOCK_KV=_next_power_of_2(num_kv_heads), BLOCK_HALF=block_half,
        num_warps=_warps_for(2 * block_h * block_half),
    )
    return query


# --------------------------------------------------------------------------------------------
# silu_and_mul
# --------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, intermediate_size, x_stride_row, out_stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride_row + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_stride_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a merged gate/up projection: ``silu(x[..., :I]) * x[..., I:]``."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul needs an even last dimension (gate and up halves), got {x.shape[-1]}")
    intermediate_size = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], intermediate_size, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or intermediate_size == 0:
        return out
    out_rows = out.view(-1, intermediate_size)
    block = min(1024, _next_power_of_2(intermediate_size))
    grid = (rows.shape[0], triton.cdiv(intermediate_size, block))
    _silu_and_mul_kernel[grid](out_rows, rows, intermediate_size, rows.stride(0), out_rows.stride(0),
                               BLOCK=block, num_warps=_warps_for(4 * block))
    return out


# --------------------------------------------------------------------------------------------
# gelu_and_mul, gelu
# --------------------------------------------------------------------------------------------

_SQRT_2_OVER_PI = 0.7978845608028654
_SQRT_HALF = 0.7071067811865476


@triton.jit
def _gelu_kernel(out_ptr, x_ptr, num_cols, x_stride_row, out_stride_row,
                 IS_GATED: tl.constexpr, IS_TANH: tl.constexpr, BLOCK: tl.constexpr):
    """GELU of ``num_cols`` columns per row; gated (GeGLU) rows multiply by the up half after them."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_TANH:
        out = 0.5 * x * (1.0 + _tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    else:
        out = 0.5 * x * (1.0 + tl.erf(x * _SQRT_HALF))
    if IS_GATED:
        out = out * tl.load(x_ptr + row * x_stride_row + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU activation of a merged gate/up projection: ``gelu(x[..., :I]) * x[..., I:]``."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"gelu_and_mul needs an even last dimension (gate and up halves), got {x.shape[-1]}")
    return _gelu(x, approximate, is_gated=True)


def gelu(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU (``approximate`` "tanh" or "none") of a non-gated MLP's up projection."""
    return _gelu(x, approximate, is_gated=False)


def _gelu(x: torch.Tensor, approximate: str, is_gated: bool) -> torch.Tensor:
    reference.check_gelu_approximate(approximate)
    num_cols = x.shape[-1] // 2 if is_gated else x.shape[-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], num_cols, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or num_cols == 0:
        return out
    out_rows = out.view(-1, num_cols)
    block = min(1024, _next_power_of_2(num_cols))
    grid = (rows.shape[0], triton.cdiv(num_cols, block))
    _gelu_kernel[grid](out_rows, rows, num_cols, rows.stride(0), out_rows.stride(0),
                       IS_GATED=is_gated, IS_TANH=approximate == "tanh", BLOCK=block, num_warps=_warps_for(4 * block))
    return out


# --------------------------------------------------------------------------------------------
# layer_norm
# --------------------------------------------------------------------------------------------


@triton.jit
def _layer_norm_kernel(
    normed_ptr, summed_ptr, x_ptr, residual_ptr, weight_ptr, bias_ptr,
    hidden_size, eps,
    x_stride_row, residual_stride_row, normed_stride_row, summed_stride_row,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride_row + cols, mask=mask, other=0.0)
        # Round the sum to its storage dtype before norming it, as the reference norms the stored sum.
        summed = (x + residual.to(tl.float32)).to(summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * summed_stride_row + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean = tl.sum(x, 0) / hidden_size
    centered = tl.where(mask, x - mean, 0.0)
    inverse_std = tl.rsqrt(tl.sum(centered * centered, 0) / hidden_size + eps)
    normed = centered * inverse_std * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        normed = normed + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * normed_stride_row + cols, normed.to(normed_ptr.dtype.element_ty), mask=mask)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of ``x + residual``; returns ``(normed, x + residual)``, both written by one kernel."""
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,) or (bias is not None and bias.shape != (hidden_size,)):
        raise ValueError(f"weight and bias must have shape ({hidden_size},) to norm rows of x {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    rows = x.reshape(-1, hidden_size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if residual is None:
        residual_rows, summed, summed_rows = rows, x, rows
    else:
        residual_rows = residual.reshape(-1, hidden_size)
        if residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
        summed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        summed_rows = summed.view(-1, hidden_size)
    normed = torch.empty(x.shape, dtype=summed.dtype, device=x.device)
    if rows.shape[0] == 0:
        return normed, summed
    block = _next_power_of_2(hidden_size)
    normed_rows = normed.view(-1, hidden_size)
    weight = weight.contiguous()
    _layer_norm_kernel[(rows.shape[0],)](
        normed_rows, summed_rows, rows, residual_rows, weight, weight if bias is None else bias.contiguous(),
        hidden_size, eps, rows.stride(0), residual_rows.stride(0), normed_rows.stride(0), summed_rows.stride(0),
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK=block, num_warps=_warps_for(block),
    )
    return normed, summed


# --------------------------------------------------------------------------------------------
# sample_from_logits
# --------------------------------------------------------------------------------------------


@triton.jit
def _gumbel_max_sample_kernel(
    best_score_ptr, best_index_ptr, logits_ptr, temperatures_ptr, seed_ptr,
    num_rows, vocab_size, logits_stride_row, split_size, num_splits, greedy_temperature,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Best of ``logits / T + Gumbel noise`` over one vocabulary split of BLOCK_R rows.

    argmax over the whole vocabulary of that score is a draw from softmax(logits / T) (the
    Gumbel-max trick), found in one streaming pass with no softmax, sort or cumsum. Greedy rows
    add no noise. Splitting the vocabulary gives a small batch enough programs to fill the GPU.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(1)
    is_real_row = rows < num_rows
    rows = rows.to(tl.int64)
    temperatures = tl.load(temperatures_ptr + rows, mask=is_real_row, other=1.0).to(tl.float32)
    is_greedy = temperatures < greedy_temperature
    inverse_temperatures = 1.0 / tl.where(is_greedy, 1.0, temperatures)
    seed = tl.load(seed_ptr)

    # Each lane keeps its own best; strict '>' keeps the lowest index among equal scores.
    best_score = tl.full([BLOCK_R, BLOCK_V], float("-inf"), dtype=tl.float32)
    best_index = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.int32)
    split_start = split * split_size
    split_end = tl.minimum(split_start + split_size, vocab_size)
    for first in range(split_start, split_end, BLOCK_V):
        cols = first + tl.arange(0, BLOCK_V)
        mask = is_real_row[:, None] & (cols < split_end)[None, :]
        logits = tl.load(logits_ptr + rows[:, None] * logits_stride_row + cols[None, :], mask=mask,
                         other=float("-inf"))
        uniform = tl.rand(seed, rows[:, None] * vocab_size + cols[None, :])
        gumbel = -tl.log(-tl.log(uniform))
        score = logits.to(tl.float32) * inverse_temperatures[:, None] + tl.where(is_greedy[:, None], 0.0, gumbel)
        score = tl.where(mask, score, float("-inf"))
        is_better = score > best_score
        best_score = tl.where(is_better, score, best_score)
        best_index = tl.where(is_better, cols[None, :], best_index)
    top = tl.max(best_score, 1)
    index = tl.min(tl.where(best_score == top[:, None], best_index, vocab_size), 1)
    # A split of all -inf logits has no best lane; answer its first index, as torch.argmax would.
    index = tl.where(index == vocab_size, split_start, index)
    out = rows * num_splits + split
    tl.store(best_score_ptr + out, top, mask=is_real_row)
    tl.store(best_index_ptr + out, index.to(tl.int64), mask=is_real_row)


# Enough vocabulary splits that a decode batch's sampling has about this many programs.
SAMPLER_TARGET_PROGRAMS = 1024


def sample_from_logits(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    generator: torch.Generator | None = None,
    min_ps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row; the semantics of ``sampling.sample_from_logits``, but a fused
    Gumbel-max kernel draws greedy and plain-temperature rows.

    Only rows with top-k, top-p or min-p go through the torch path (``torch.topk``, then top-p
    within the top k). The kernel's noise is Triton's Philox stream, seeded from ``generator``, so
    draws are reproducible for a given generator state but differ from the reference's draws.
    Deciding which rows need the torch path reads one flag on the host.
    """
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    needs_filtering = sampling.rows_needing_filtering(temperatures, top_ks, top_ps, vocab_size, min_ps)
    num_filtered = int(needs_filtering.sum())
    if num_filtered == num_rows:
        return sampling.sample_from_logits(logits, temperatures, top_ks, top_ps, generator, min_ps)
    tokens = _gumbel_max_sample(logits, temperatures, generator)
    if num_filtered:
        rows = needs_filtering.nonzero().squeeze(1)
        tokens[rows] = sampling.sample_from_logits(
            logits[rows], temperatures[rows], top_ks[rows], top_ps[rows], generator,
            None if min_ps is None else min_ps[rows],
        )
    return tokens


def _gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, generator) -> torch.Tensor:
    num_rows, vocab_size = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # The seed stays on the device: no host sync, and the launch can be captured in a CUDA graph.
    seed_device = generator.device if generator is not None else logits.device
    seed = torch.randint(2**31 - 1, (1,), generator=generator, device=seed_device).to(logits.device)
    # Tiles of about 4096 logits: a slice of one row, or many whole rows of a tiny vocabulary.
    block_v = min(4096, _next_power_of_2(vocab_size))
    block_r = min(4096 // block_v, _next_power_of_2(num_rows))
    num_row_blocks = triton.cdiv(num_rows, block_r)
    num_splits = max(1, min(triton.cdiv(vocab_size, block_v), SAMPLER_TARGET_PROGRAMS // num_row_blocks))
    split_size = triton.cdiv(triton.cdiv(vocab_size, num_splits), block_v) * block_v
    num_splits = triton.cdiv(vocab_size, split_size)
    best_score = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(num_rows, num_splits, dtype=torch.int64, device=logits.device)
    _gumbel_max_sample_kernel[(num_row_blocks, num_splits)](
        best_score, best_index, logits, temperatures, seed,
        num_rows, vocab_size, logits.stride(0), split_size, num_splits, sampling.GREEDY_TEMPERATURE,
        BLOCK_R=block_r, BLOCK_V=block_v, num_warps=8,
    )
    # torch.argmax takes the first of equal maxima: the lowest split, whose index is the lowest.
    best_split = best_score.argmax(dim=1, keepdim=True)
    return best_index.gather(1, best_split).squeeze(1)
