"""Triton: store new keys and values at their slots of the paged cache; see ``reference.py``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import next_power_of_2, warps_for


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
    block_h, block_d = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        num_kv_heads, head_dim, key_cache.shape[1],
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps_for(block_h * block_d),
    )
