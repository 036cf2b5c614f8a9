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
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of variable-length queries over a paged KV cache (prefill, extend and decode).

    query: ``[T, Hq, D]``, the new tokens of B sequences laid end to end (``query_start_loc``, ``[B+1]``).
    Each sequence's keys are its first ``context_lens[b]`` cache slots, found through
    ``block_tables[b]``; its queries are the last ``q_len`` of those positions. GQA when Hq > Hkv.
    ``sliding_window`` w lets a query see only the last w positions up to its own.
    ``soft_cap`` c (Gemma 2) squashes the scaled scores to ``c * tanh(scores / c)`` before the mask
    and the softmax. Returns ``[T, Hq, D]``.
    """
    check_soft_cap(soft_cap)
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

    out = scaled_dot_product_attention(
        padded_query.transpose(1, 2),
        keys.transpose(1, 2).to(query.dtype),
        values.transpose(1, 2).to(query.dtype),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
        soft_cap=soft_cap,
    )
    return out.transpose(1, 2)[token_seq, token_row]


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
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``[T, H, D]`` queries and keys at ``positions``.

    ``cos_sin_cache`` is ``[max_position, R]``: the cosines in the first half, sines in the second.
    The first R dims of each head rotate and the other D - R pass through unchanged (partial rotary,
    R < D, as in Phi-3/4-mini). NeoX style (rotate-half) pairs dim i with i + R/2; GPT-J style
    (``is_neox_style=False``, Cohere) pairs dims 2i and 2i + 1.
    """
    check_rotary_dim(query.shape[-1], cos_sin_cache.shape[-1])
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    if is_neox_style:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    else:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(query, cos, sin, is_neox_style), _rotate(key, cos, sin, is_neox_style)


def check_rotary_dim(head_dim: int, rotary_dim: int) -> None:
    """ValueError unless the rotary table's width is even and at most the head size."""
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos_sin_cache must be [max_position, R] with R even and R <= head_dim ({head_dim}), "
                         f"got R = {rotary_dim}")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = True) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = _rotate(x[..., :rotary_dim], cos, sin, is_neox_style)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    if is_neox_style:
        first, second = x.chunk(2, dim=-1)
        rotated_half = torch.cat((-second, first), dim=-1)
    else:
        pairs = x.unflatten(-1, (-1, 2))
        rotated_half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x * cos + rotated_half * sin).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a merged gate/up projection: ``silu(x[..., :I]) * x[..., I:]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


GELU_APPROXIMATIONS = ("tanh", "none")


def check_gelu_approximate(approximate: str) -> None:
    """ValueError unless ``approximate`` names a GELU of ``F.gelu``."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU activation of a merged gate/up projection: ``gelu(x[..., :I]) * x[..., I:]``.

    ``approximate="tanh"`` is HF's ``gelu_pytorch_tanh`` (Gemma), ``"none"`` the exact erf GELU.
    """
    check_gelu_approximate(approximate)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def gelu(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU of a non-gated MLP's up projection (StarCoder2)."""
    check_gelu_approximate(approximate)
    return F.gelu(x, approximate=approximate)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of ``x + residual`` over the last dimension; returns ``(normed, x + residual)``.

    All of it in float32, weight and bias included, rounded once to the dtype of the sum (as
    ``nn.LayerNorm`` and HF's ``CohereLayerNorm`` do). ``bias`` may be None (Cohere has none).
    """
    if residual is not None:
        x = x + residual
    hidden = x.float()
    mean = hidden.mean(-1, keepdim=True)
    centered = hidden - mean
    normed = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if bias is not None:
        normed = normed + bias.float()
    return normed.to(x.dtype), x


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum of each row of ``[R, V]`` (NaN counts as the largest)."""
    return x.argmax(dim=-1)
