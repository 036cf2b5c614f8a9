"""Triton device function shared by the prefill and decode kernels: online softmax over a key range
of the paged cache."""
from __future__ import annotations

import triton
import triton.language as tl

from ..triton_utils import tanh


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
            scores = tanh(scores * (softmax_scale_log2 / soft_cap_log2)) * soft_cap_log2
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
