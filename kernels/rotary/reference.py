"""Plain torch: rotary position embedding (NeoX or GPT-J pairs, partial rotary)."""
from __future__ import annotations

import torch


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
