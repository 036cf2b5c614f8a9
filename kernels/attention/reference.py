"""Plain torch: causal attention over the paged KV cache, the semantics the CPU and Triton
versions are tested against. No function here loops over sequences in Python: batches are padded
and masked instead."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    """Causal attention of variable-length queries over a paged KV cache (prefill, extend and decode).

    query: ``[T, Hq, D]``, the new tokens of B sequences laid end to end (``query_start_loc``, ``[B+1]``).
    Each sequence's keys are its first ``context_lens[b]`` cache slots, found through
    ``block_tables[b]``; its queries are the last ``q_len`` of those positions. GQA when Hq > Hkv.
    ``sliding_window`` w lets a query see only the last w positions up to its own.
    ``soft_cap`` c (Gemma 2) squashes the scaled scores to ``c * tanh(scores / c)`` before the mask
    and the softmax. ``kv_scales`` ``[2]``: a quantized (fp8) cache holds keys / k_scale and
    values / v_scale, so they are multiplied back; None: scales of 1. Returns ``[T, Hq, D]``.
    """
    check_soft_cap(soft_cap)
    check_kv_scales(key_cache, kv_scales)
    num_seqs = context_lens.shape[0]
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_context_blocks = -(-max_context_len // block_size)
    tables = block_tables[:, :num_context_blocks]
    padded_len = num_context_blocks * block_size
    keys = dequantized(key_cache[tables], kv_scales, 0, query.dtype).reshape(num_seqs, padded_len, num_kv_heads,
                                                                              head_dim)
    values = dequantized(value_cache[tables], kv_scales, 1, query.dtype).reshape(num_seqs, padded_len, num_kv_heads,
                                                                                  head_dim)

    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=query.device), query_lens, output_size=num_tokens)
    token_row = torch.arange(num_tokens, device=query.device) - query_start_loc[token_seq]
    padded_query = query.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    padded_query[token_seq, token_row] = query

    query_pos = (context_lens - query_lens)[:, None] + torch.arange(max_query_len, device=query.device)[None]
    key_pos = torch.arange(padded_len, device=query.device)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window

    out = scaled_dot_product_attention(
        padded_query.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
        soft_cap=soft_cap,
    )
    return out.transpose(1, 2)[token_seq, token_row]


def dequantized(cache_rows: torch.Tensor, kv_scales: torch.Tensor | None, which: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Cache rows in ``dtype``: an fp8 cache's rows times their scale (``kv_scales[which]``), in fp32 first."""
    if cache_rows.dtype == torch.float8_e4m3fn:
        rows = cache_rows.to(torch.float32)
        return (rows if kv_scales is None else rows * kv_scales[which]).to(dtype)
    return cache_rows.to(dtype)


def check_kv_scales(key_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """ValueError unless ``kv_scales`` is None or a float32 ``[2]`` tensor on the cache's device
    for an fp8 cache (other caches hold keys and values as they are)."""
    if kv_scales is None:
        return
    if key_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"kv_scales are for an fp8 (float8_e4m3fn) cache; this cache is {key_cache.dtype}")
    if kv_scales.shape != (2,) or kv_scales.dtype != torch.float32 or kv_scales.device != key_cache.device:
        raise ValueError(f"kv_scales must be a float32 [2] tensor (key scale, value scale) on {key_cache.device}, "
                         f"got {kv_scales.dtype} {tuple(kv_scales.shape)} on {kv_scales.device}")


def check_soft_cap(soft_cap: float | None) -> None:
    """ValueError unless ``soft_cap`` is None or a positive number."""
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be None or > 0, got {soft_cap}")


def scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                                 soft_cap=None):
    """``F.scaled_dot_product_attention`` (``[B, H, L, D]`` inputs), plus logit soft-capping.

    SDPA has no soft cap, so with one the attention is written out: scores in float32, capped to
    ``soft_cap * tanh(scores / soft_cap)``, then masked (a boolean mask hides False, a float mask
    adds) and soft-maxed, as HF's eager Gemma 2 attention does.
    """
    if soft_cap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.matmul(torch.softmax(scores, dim=-1), value.float()).to(query.dtype)
