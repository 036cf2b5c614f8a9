"""CPU: paged attention as ``reference.py`` computes it, with shorter formulations for the shapes
a CPU engine runs most (decode steps with one query per sequence, a single sequence's prefill) and
masks and gather indices built once per step. Every shortcut calls
``reference.scaled_dot_product_attention``: SDPA itself, or with a soft cap the written-out form.
"""
from __future__ import annotations

import torch

from ..step_memo import memo as _memo
from . import reference


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                    max_query_len, max_context_len, scale, sliding_window=None, soft_cap=None):
    """As :func:`reference.paged_attention`, with shortcuts for decode steps and single prefills.

    Every shortcut calls ``reference.scaled_dot_product_attention``: SDPA itself, or with a
    ``soft_cap`` the written-out attention that caps the scores.
    """
    reference.check_soft_cap(soft_cap)
    num_seqs = context_lens.shape[0]
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_tokens == 0 or num_heads % num_kv_heads:
        return reference.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                         query_start_loc, max_query_len, max_context_len, scale, sliding_window,
                                         soft_cap)
    if max_query_len == 1 and num_tokens == num_seqs:
        return _decode_attention(query, key_cache, value_cache, block_tables, context_lens, max_context_len,
                                 scale, sliding_window, soft_cap)
    if num_seqs == 1:
        return _single_sequence_attention(query, key_cache, value_cache, block_tables, context_lens,
                                          max_context_len, scale, sliding_window, soft_cap)
    split = _split_of_lopsided_batch(query_start_loc, context_lens, max_query_len, max_context_len)
    if split is not None:
        return _lopsided_attention(query, key_cache, value_cache, block_tables, split, scale, sliding_window,
                                   soft_cap)
    return _varlen_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                             max_query_len, max_context_len, scale, sliding_window, soft_cap)


# A mixed batch is padded to its longest query and context. When that multiplies the work by more
# than this (one long prefill beside many short queries, as when a burst of requests shares a new
# prefix within one step), the long queries run on their own and only the short ones are padded.
_MAX_PADDING_FACTOR = 2


def _split_of_lopsided_batch(query_start_loc, context_lens, max_query_len, max_context_len):
    """None, or ``(long, short)``: ``long`` lists ``(seq, first token, end token, context_len)`` of the
    queries longer than a quarter of the longest; ``short`` holds the rest as a sub-batch ``(token
    rows, sequences, query_start_loc, context_lens, max_query_len, max_context_len)`` or None. Once per step."""
    def compute():
        starts = query_start_loc.tolist()
        query_lens = [end - start for start, end in zip(starts, starts[1:])]
        contexts = context_lens.tolist()
        needed = sum(q * c for q, c in zip(query_lens, contexts))
        if len(query_lens) * max_query_len * max_context_len <= _MAX_PADDING_FACTOR * max(needed, 1):
            return None
        threshold = max(1, max_query_len // 4)
        long = [(seq, starts[seq], starts[seq + 1], contexts[seq]) for seq, q in enumerate(query_lens) if q > threshold]
        short_seqs = [seq for seq, q in enumerate(query_lens) if 0 < q <= threshold]
        if not short_seqs:
            return long, None
        short_lens = [query_lens[seq] for seq in short_seqs]
        device = query_start_loc.device
        rows = torch.tensor([row for seq in short_seqs for row in range(starts[seq], starts[seq + 1])], device=device)
        sub_starts = torch.tensor([0, *short_lens], device=device).cumsum(0).to(query_start_loc.dtype)
        short_contexts = [contexts[seq] for seq in short_seqs]
        short = (rows, torch.tensor(short_seqs, device=device), sub_starts,
                 torch.tensor(short_contexts, dtype=context_lens.dtype, device=device), max(short_lens),
                 max(short_contexts))
        return long, short

    return _memo.get("lopsided_split", (query_start_loc, context_lens, max_query_len, max_context_len), compute)


def _lopsided_attention(query, key_cache, value_cache, block_tables, split, scale, sliding_window, soft_cap):
    long, short = split
    out = query.new_empty(query.shape)
    for seq, start, end, context_len in long:  # (a lone sequence's context length is its max_context_len)
        out[start:end] = _single_sequence_attention(query[start:end], key_cache, value_cache,
                                                    block_tables[seq:seq + 1], None, context_len, scale,
                                                    sliding_window, soft_cap)
    if short is not None:
        rows, seqs, sub_starts, sub_contexts, max_query_len, max_context_len = short
        out[rows] = _varlen_attention(query[rows], key_cache, value_cache, block_tables[seqs], sub_contexts, sub_starts,
                                      max_query_len, max_context_len, scale, sliding_window, soft_cap)
    return out



def _gather(cache: torch.Tensor, blocks: tuple, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
    """The blocks of each sequence as ``[B, Hkv, padded_len, D]``: a view when they are one
    contiguous run of the cache (as a lone sequence's fresh blocks usually are), else a copy."""
    flat_blocks, first_block = blocks
    _, block_size, num_kv_heads, head_dim = cache.shape
    if first_block is not None:
        gathered = cache.narrow(0, first_block, flat_blocks.shape[0])
    else:
        gathered = cache.index_select(0, flat_blocks)
    gathered = gathered.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    return gathered if gathered.dtype == dtype else gathered.to(dtype)


def _context_blocks(block_tables: torch.Tensor, num_context_blocks: int) -> tuple:
    """``(flat block ids, first id if they are consecutive else None)``, once per step."""
    def compute():
        flat_blocks = block_tables[:, :num_context_blocks].reshape(-1).long()
        ids = flat_blocks.tolist() if flat_blocks.shape[0] <= 4096 else []
        is_one_run = bool(ids) and ids == list(range(ids[0], ids[0] + len(ids)))
        return flat_blocks, ids[0] if is_one_run else None

    return _memo.get("context_blocks", (block_tables, num_context_blocks), compute)


def _decode_attention(query, key_cache, value_cache, block_tables, context_lens, max_context_len, scale,
                      sliding_window, soft_cap=None):
    """One query per sequence: the query heads that share a KV head become that head's query rows,
    so the attention is a plain (non-GQA) SDPA call over the gathered keys."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_context_blocks = -(-max_context_len // block_size)
    blocks = _context_blocks(block_tables, num_context_blocks)
    keys = _gather(key_cache, blocks, num_seqs, query.dtype)
    values = _gather(value_cache, blocks, num_seqs, query.dtype)
    grouped_query = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = _decode_mask(context_lens, num_context_blocks * block_size, max_context_len, sliding_window)
    if mask is None:  # one sequence and no window: its first max_context_len keys, nothing to hide
        keys, values = keys[:, :, :max_context_len], values[:, :, :max_context_len]
    out = reference.scaled_dot_product_attention(grouped_query, keys, values, attn_mask=mask, scale=scale,
                                                 soft_cap=soft_cap)
    return out.view(num_seqs, num_heads, head_dim)


def _decode_mask(context_lens, padded_len, max_context_len, sliding_window):
    if context_lens.shape[0] == 1 and sliding_window is None:
        return None

    def compute():
        key_pos = torch.arange(padded_len, device=context_lens.device)
        visible = key_pos[None, :] < context_lens[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] >= (context_lens[:, None] - sliding_window)
        return visible[:, None, None, :]

    return _memo.get("decode_mask", (context_lens, padded_len, sliding_window), compute)


# Causal attention of a long prefill runs in chunks of this many queries, each against only the
# keys it can see: SDPA's CPU kernel computes whole key blocks and masks them afterwards, so one
# call does nearly twice the necessary work (measured 20 % faster for a 500-token prefill).
_PREFILL_QUERY_CHUNK = 64


def _single_sequence_attention(query, key_cache, value_cache, block_tables, context_lens, max_context_len, scale,
                               sliding_window, soft_cap=None):
    """One sequence's prefill (or prefill chunk after a cached prefix): no padding, so no gather
    of other sequences, and for a short fresh prefill without a window, SDPA's own causal path."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_context_blocks = -(-max_context_len // block_size)
    blocks = _context_blocks(block_tables, num_context_blocks)
    keys = _gather(key_cache, blocks, 1, query.dtype)[:, :, :max_context_len]
    values = _gather(value_cache, blocks, 1, query.dtype)[:, :, :max_context_len]
    if num_tokens < 2 * _PREFILL_QUERY_CHUNK:
        queries = query.transpose(0, 1).unsqueeze(0)
        is_fresh = num_tokens == max_context_len
        mask = None if is_fresh and sliding_window is None else _prefill_biases(
            num_tokens, max_context_len, sliding_window, num_tokens, 1, query.dtype, query.device)[0]
        out = reference.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=mask is None,
                                                     scale=scale, enable_gqa=num_heads != num_kv_heads,
                                                     soft_cap=soft_cap)
        return out[0].transpose(0, 1)
    return _chunked_prefill_attention(query, keys, values, max_context_len, scale, sliding_window, soft_cap)


def _chunked_prefill_attention(query, keys, values, context_len, scale, sliding_window, soft_cap=None):
    """Causal attention in chunks of queries, with the query heads that share a KV head stacked as
    that head's rows (token-major): the SDPA calls are then plain multi-head ones with three times
    the rows, which its CPU kernel runs ~10 % faster than the GQA form, and each chunk's result is
    copied straight into the output instead of concatenated at the end."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    num_queries_per_kv = num_heads // num_kv_heads
    grouped_query = query.view(num_tokens, num_kv_heads, num_queries_per_kv, head_dim).transpose(0, 1)
    grouped_query = grouped_query.reshape(1, num_kv_heads, num_tokens * num_queries_per_kv, head_dim)
    out = query.new_empty(num_tokens, num_kv_heads, num_queries_per_kv, head_dim)
    out_by_kv_head = out.transpose(0, 1)
    biases = _prefill_biases(num_tokens, context_len, sliding_window, _PREFILL_QUERY_CHUNK, num_queries_per_kv,
                             query.dtype, query.device)
    first_query_pos = context_len - num_tokens
    for bias, start in zip(biases, range(0, num_tokens, _PREFILL_QUERY_CHUNK)):
        end = min(start + _PREFILL_QUERY_CHUNK, num_tokens)
        num_visible = first_query_pos + end
        chunk_out = reference.scaled_dot_product_attention(
            grouped_query[:, :, start * num_queries_per_kv:end * num_queries_per_kv], keys[:, :, :num_visible],
            values[:, :, :num_visible], attn_mask=bias, scale=scale, soft_cap=soft_cap)
        out_by_kv_head[:, start:end].copy_(chunk_out[0].view(num_kv_heads, end - start, num_queries_per_kv, head_dim))
    return out.view(num_tokens, num_heads, head_dim)


def _prefill_biases(num_tokens, context_len, sliding_window, chunk, rows_per_query, dtype, device):
    """Per chunk of ``chunk`` queries, an additive mask (0 or -inf) over the keys up to its last
    query, each query's row repeated ``rows_per_query`` times (once per query head of a KV head).

    Additive rather than boolean because SDPA's CPU kernel turns a boolean mask into this on every
    call (measured 6 % of a 500-token prefill's attention)."""
    def compute():
        biases = []
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            first_query_pos = context_len - num_tokens
            query_pos = torch.arange(first_query_pos + start, first_query_pos + end, device=device)[:, None]
            key_pos = torch.arange(first_query_pos + end, device=device)[None, :]
            visible = key_pos <= query_pos
            if sliding_window is not None:
                visible &= key_pos > query_pos - sliding_window
            bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            biases.append(bias.repeat_interleave(rows_per_query, dim=0))
        return biases

    return _memo.get("prefill_biases", (num_tokens, context_len, sliding_window, chunk, rows_per_query, dtype),
                     compute)


def _varlen_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc, max_query_len,
                      max_context_len, scale, sliding_window, soft_cap=None):
    """A mixed batch: the reference's padded formulation, with its index and mask tensors built once
    per step."""
    num_seqs = context_lens.shape[0]
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_context_blocks = -(-max_context_len // block_size)
    padded_len = num_context_blocks * block_size

    def plan():
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=query.device), query_lens,
                                            output_size=num_tokens)
        token_row = torch.arange(num_tokens, device=query.device) - query_start_loc[token_seq]
        query_pos = (context_lens - query_lens)[:, None] + torch.arange(max_query_len, device=query.device)[None]
        key_pos = torch.arange(padded_len, device=query.device)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
        return token_seq, token_row, mask[:, None]

    token_seq, token_row, mask = _memo.get(
        "varlen_plan", (query_start_loc, context_lens, max_query_len, padded_len, sliding_window), plan)
    blocks = _context_blocks(block_tables, num_context_blocks)
    keys = _gather(key_cache, blocks, num_seqs, query.dtype)
    values = _gather(value_cache, blocks, num_seqs, query.dtype)
    padded_query = query.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    padded_query[token_seq, token_row] = query
    out = reference.scaled_dot_product_attention(padded_query.transpose(1, 2), keys, values, attn_mask=mask,
                                                 scale=scale, enable_gqa=num_heads != num_kv_heads, soft_cap=soft_cap)
    return out.transpose(1, 2)[token_seq, token_row]
