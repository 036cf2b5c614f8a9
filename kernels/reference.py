"""Plain-torch reference implementations of every kernel.

They define the semantics each Triton kernel is tested against, and they are the CPU path.
No function here loops over sequences in Python: batches are padded and masked instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys/values ``[T, Hkv, D]`` at flat slots of a paged cache ``[blocks, block_size, Hkv, D]``."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


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
) -> torch.Tensor:
    """Causal attention of variable-length queries over a paged KV cache (prefill, extend and decode).

    query: ``[T, Hq, D]``, the new tokens of B sequences laid end to end (``query_start_loc``, ``[B+1]``).
    Each sequence's keys are its first ``context_lens[b]`` cache slots, found through
    ``block_tables[b]``; its queries are the last ``q_len`` of those positions. GQA when Hq > Hkv.
    Returns ``[T, Hq, D]``.
    """
    num_seqs = context_lens.shape[0]
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_context_blocks = -(-max_context_len // block_size)
    tables = block_tables[:, :num_context_blocks]
    padded_len = num_context_blocks * block_size
    keys = key_cache[tables].reshape(num_seqs, padded_len, num_kv_heads, head_dim)
    values = value_cache[tables].reshape(num_seqs, padded_len, num_kv_heads, head_dim)

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

    out = F.scaled_dot_product_attention(
        padded_query.transpose(1, 2),
        keys.transpose(1, 2).to(query.dtype),
        values.transpose(1, 2).to(query.dtype),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.transpose(1, 2)[token_seq, token_row]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual``; returns ``(normed, x + residual)`` so the sum feeds the next residual."""
    if residual is not None:
        x = x + residual
    hidden = x.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (NeoX style) rotary embedding of ``[T, H, D]`` queries and keys.

    ``cos_sin_cache`` is ``[max_position, D]``: the cosines in the first half, sines in the second.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return (x * cos + rotated_half * sin).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a merged gate/up projection: ``silu(x[..., :I]) * x[..., I:]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum of each row of ``[R, V]`` (NaN counts as the largest)."""
    return x.argmax(dim=-1)
