"""Triton: rotary embedding (NeoX or GPT-J pairs, partial rotary); see ``reference.py``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import next_power_of_2, warps_for
from . import reference


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
    block_h, block_half = next_power_of_2(num_heads), next_power_of_2(rotary_dim // 2)
    _rotary_embedding_kernel[(num_tokens,)](
        out, x, positions, cos_sin_cache, num_heads, rotary_dim // 2, head_dim,
        *x.stride(), out.stride(0), out.stride(1), cos_sin_cache.stride(0),
        IS_NEOX=is_neox_style, HAS_PASS_THROUGH=rotary_dim < head_dim,
        BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=next_power_of_2(head_dim - rotary_dim),
        num_warps=warps_for(2 * block_h * block_half),
    )
    return out
