"""CPU: rotary embedding of queries and keys together, tables built once per step."""
from __future__ import annotations

import torch

from ..step_memo import memo as _memo
from . import reference


def rotary_embedding(query, key, positions, cos_sin_cache, is_neox_style=True):
    """As :func:`reference.rotary_embedding`, with queries and keys rotated together in four ops.

    Rotate-half is ``x * cos + roll(x, R/2) * [-sin, sin]``; GPT-J style is the same with each pair
    of dims swapped instead of rolled. The full-width tables are built once per step. A partial
    rotary (R < D) rotates only the first R dims and passes the rest through.
    """
    head_dim, rotary_dim = query.shape[-1], cos_sin_cache.shape[-1]
    if not is_neox_style or rotary_dim != head_dim:
        return _rotary_embedding_general(query, key, positions, cos_sin_cache, is_neox_style)
    num_query_heads = query.shape[1]
    cos, signed_sin = _memo.get("rotary", (positions, cos_sin_cache), lambda: _rotary_tables(positions, cos_sin_cache))
    both = torch.cat((query, key), dim=1)
    rotated = torch.addcmul(both * cos, both.roll(both.shape[-1] // 2, dims=-1), signed_sin)
    return rotated[:, :num_query_heads], rotated[:, num_query_heads:]


def _rotary_tables(positions, cos_sin_cache):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def _rotary_embedding_general(query, key, positions, cos_sin_cache, is_neox_style):
    reference.check_rotary_dim(query.shape[-1], cos_sin_cache.shape[-1])
    rotary_dim, num_query_heads = cos_sin_cache.shape[-1], query.shape[1]
    if is_neox_style:
        cos, signed_sin = _memo.get("rotary", (positions, cos_sin_cache),
                                    lambda: _rotary_tables(positions, cos_sin_cache))
    else:
        cos, signed_sin = _memo.get("rotary_interleaved", (positions, cos_sin_cache),
                                    lambda: _interleaved_rotary_tables(positions, cos_sin_cache))
    both = torch.cat((query, key), dim=1)
    rotating = both[..., :rotary_dim]
    if is_neox_style:
        partners = rotating.roll(rotary_dim // 2, dims=-1)
    else:
        partners = rotating.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    rotated = torch.addcmul(rotating * cos, partners, signed_sin).to(both.dtype)
    if rotary_dim < both.shape[-1]:
        rotated = torch.cat((rotated, both[..., rotary_dim:]), dim=-1)
    return rotated[:, :num_query_heads], rotated[:, num_query_heads:]


def _interleaved_rotary_tables(positions, cos_sin_cache):
    """GPT-J style: dims 2i and 2i + 1 share cos_i and sin_i; the even dim takes -sin."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    signed_sin = torch.stack((-sin, sin), dim=-1).flatten(-2)
    return cos.repeat_interleave(2, dim=-1)[:, None, :], signed_sin[:, None, :]
