"""Triton: decode attention (one query token per sequence) over the paged KV cache, split-K with
the split chosen per sequence on the device; see ``reference.py``.

One program attends one split of one sequence's keys for all the query heads of one KV head (GQA),
so every key and value tile is read once for its whole group. A batch has ``num_splits`` splits
per (sequence, KV head), chosen on the host from the batch size and the SM count only; each
sequence then cuts its own context into at most that many pieces of at least
``min_split_tokens`` keys. That keeps a CUDA graph (captured for the longest context) honest
about the real lengths: a 300-token sequence runs one program, an 8k one runs ``num_splits``.
Sequences cut into more than one piece write partial softmaxes that a small reduce kernel merges;
the others write their output directly and the reduce skips them.

An fp8 cache is read as stored and its per-layer scales are folded into the softmax scale (keys)
and the output (values), so the tiles need no per-element multiply.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..triton_utils import next_power_of_2, tanh
from .triton_tiles import _attend_to_key_range


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """How decode attention is launched (the defaults were picked on an H200, head_dim 128, bf16).

    ``programs_per_sm``: the split count aims at this many programs per SM over the batch;
    ``max_splits``: its cap (a power of two); ``min_split_tokens``: no piece of a context is shorter.
    ``use_dot``: scores and outputs by ``tl.dot`` (the group's heads padded to 16 rows), else by
    broadcast multiply-and-sum over the group's real heads only.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 8
    max_splits: int = 16
    min_split_tokens: int = 256
    use_dot: bool = True


DEFAULT_LAUNCH = DecodeLaunch()
_SM_COUNTS: dict[int, int] = {}
# Where there is no CUDA device (the Triton interpreter): an H200's count.
_FALLBACK_SM_COUNT = 132


@triton.jit
def _attend_without_dot(
    acc, row_max, row_sum, query, key_start, key_end,
    key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
    block_size, head_dim, softmax_scale_log2, soft_cap_log2,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
    HAS_SOFT_CAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``triton_tiles._attend_to_key_range`` for one query position, on CUDA cores: a group of
    2 or 4 heads would fill 1/8 or 1/4 of a 16-row ``tl.dot``. ``query`` is ``[G, D]`` fp32."""
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    for tile_start in range(key_start, key_end, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        is_key_in_range = key_pos < key_end
        block = tl.load(block_table_ptr + key_pos // block_size, mask=is_key_in_range, other=0).to(tl.int64)
        slot_in_block = key_pos % block_size
        load_mask = is_key_in_range[:, None] & dim_mask[None, :]
        key = tl.load(
            key_cache_ptr + block[:, None] * key_cache_stride_block + slot_in_block[:, None] * key_cache_stride_slot
            + kv_head * key_cache_stride_head + dims[None, :] * key_cache_stride_dim,
            mask=load_mask, other=0.0,
        ).to(tl.float32)
        value = tl.load(
            value_cache_ptr + block[:, None] * value_cache_stride_block
            + slot_in_block[:, None] * value_cache_stride_slot
            + kv_head * value_cache_stride_head + dims[None, :] * value_cache_stride_dim,
            mask=load_mask, other=0.0,
        ).to(tl.float32)
        scores = tl.sum(query[:, None, :] * key[None, :, :], 2)  # [G, N]
        if HAS_SOFT_CAP:
            scores = tanh(scores * (softmax_scale_log2 / soft_cap_log2)) * soft_cap_log2
        else:
            scores = scores * softmax_scale_log2
        scores = tl.where(is_key_in_range[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        rescale = tl.exp2(row_max - safe_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.sum(probs[:, :, None] * value[None, :, :], 1)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _used_splits(context_len, first_key, num_splits, BLOCK_N: tl.constexpr, min_split_tiles):
    """Pieces this sequence's keys are cut into, and the tiles each piece takes."""
    num_tiles = tl.maximum(tl.cdiv(context_len - first_key, BLOCK_N), 1)
    used = tl.maximum(tl.minimum(tl.cdiv(num_tiles, min_split_tiles), num_splits), 1)
    tiles_per_split = tl.cdiv(num_tiles, used)
    # Recounted so no piece starts past the context (19 tiles in 8 pieces: 7 of 3 tiles).
    return tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1), tiles_per_split


# The split count and the minimum piece change with the batch and the launch: specializing on them
# (== 1) would compile a second variant of each kernel.
@triton.jit(do_not_specialize=["num_splits", "min_split_tiles"])
def _split_decode_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    kv_scales_ptr,
    num_heads,
    out_stride_token, out_stride_head, out_stride_dim,
    query_stride_token, query_stride_head, query_stride_dim,
    block_tables_stride_seq,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
    num_queries_per_kv, block_size, head_dim, softmax_scale_log2, soft_cap_log2, sliding_window,
    num_splits, min_split_tiles,
    HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_KV_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, USE_DOT: tl.constexpr,
):
    """One program: one piece of one sequence's keys, for the query heads of one KV head."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if query_len != 1:  # an empty (padding) sequence
        return
    context_len = tl.load(context_lens_ptr + seq)
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
    if USE_DOT:
        acc, row_max, row_sum = _attend_to_key_range(
            acc, row_max, row_sum, query, rows, key_start, key_end,
            key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
            block_size, head_dim, score_scale, soft_cap_log2, sliding_window,
            key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
            value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
            MASK_BY_QUERY_POSITION=False, HAS_SLIDING_WINDOW=False,
            HAS_SOFT_CAP=HAS_SOFT_CAP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_IN_FP32=DOT_IN_FP32,
        )
    else:
        acc, row_max, row_sum = _attend_without_dot(
            acc, row_max, row_sum, query.to(tl.float32), key_start, key_end,
            key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
            block_size, head_dim, score_scale, soft_cap_log2,
            key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
            value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
            HAS_SOFT_CAP=HAS_SOFT_CAP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        )
    out = acc * (value_scale / tl.where(row_sum == 0.0, 1.0, row_sum))[:, None]
    if used > 1:
        stat_index = (seq.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(partial_max_ptr + stat_index, row_max, mask=is_real_row)
        tl.store(partial_sum_ptr + stat_index, row_sum, mask=is_real_row)
        tl.store(partial_out_ptr + stat_index[:, None] * BLOCK_D + dims[None, :], out, mask=row_mask)
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


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      launch: DecodeLaunch = DEFAULT_LAUNCH) -> int:
    """Splits per (sequence, KV head): enough for ``launch.programs_per_sm`` programs per SM, a
    power of two up to ``launch.max_splits``, and no more than the longest context can use."""
    wanted = triton.cdiv(launch.programs_per_sm * _sm_count(device), max(1, num_seqs * num_kv_heads))
    usable = triton.cdiv(max(1, max_context_len), launch.min_split_tokens)
    return min(next_power_of_2(min(wanted, usable)), launch.max_splits)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _FALLBACK_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                     max_context_len, kv_scales, common, launch: DecodeLaunch = DEFAULT_LAUNCH) -> None:
    """Writes decode attention into ``out``; ``common`` holds the kernel arguments
    ``triton_attention.paged_attention`` shares with its prefill kernel."""
    num_heads = query.shape[1]
    num_seqs, num_kv_heads = context_lens.shape[0], key_cache.shape[2]
    sliding_window = common["sliding_window"] if common["HAS_SLIDING_WINDOW"] else None
    longest_span = max_context_len if sliding_window is None else min(max_context_len, sliding_window)
    block_d = common["BLOCK_D"]
    # D > 128 halves the key tile so the fp32 accumulator and the tiles stay in registers.
    block_n = launch.block_n // (2 if block_d > 128 else 1)
    min_split_tiles = max(1, launch.min_split_tokens // block_n)
    num_splits = num_decode_splits(num_seqs, num_kv_heads, longest_span, query.device, launch)
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device)
        partial_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:  # never written: every sequence is one piece
        partial_out = partial_max = partial_sum = out
    _split_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, partial_out, partial_max, partial_sum,
        query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
        kv_scales if kv_scales is not None else out,
        num_heads,
        *out.stride(), *query.stride(), block_tables.stride(0), *key_cache.stride(), *value_cache.stride(),
        num_splits=num_splits, min_split_tiles=min_split_tiles, HAS_KV_SCALES=kv_scales is not None,
        # tl.dot needs at least 16 rows; the heads of one group are padded up to that.
        BLOCK_M=next_power_of_2(common["num_queries_per_kv"]) if not launch.use_dot
        else max(16, next_power_of_2(common["num_queries_per_kv"])),
        BLOCK_N=block_n, USE_DOT=launch.use_dot,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **common,
    )
    if num_splits > 1:
        _split_decode_reduce_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_max, partial_sum, context_lens, query_start_loc,
            num_heads, common["head_dim"], common["sliding_window"], num_splits, min_split_tiles,
            *out.stride(), HAS_SLIDING_WINDOW=common["HAS_SLIDING_WINDOW"],
            BLOCK_S=next_power_of_2(launch.max_splits),
            BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4,
        )
