"""Triton: store new keys and values at their slots of the paged cache; see ``reference.py``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import next_power_of_2, warps_for
from .reference import FP8_DTYPE


@triton.jit
def as_cache_rows(rows, kv_scales_ptr, which: tl.constexpr, IS_FP8: tl.constexpr, HAS_KV_SCALES: tl.constexpr,
                  ROUND_IN_FP32: tl.constexpr):
    """``rows`` ready to store in the cache: for an fp8 cache divided by the scale ``kv_scales[which]``
    and saturated to the e4m3 range; the store's conversion then rounds to nearest (on the GPU, in
    hardware; with ROUND_IN_FP32 the rows are put on the e4m3 grid first, half away from zero)."""
    if IS_FP8:
        rows = rows.to(tl.float32)
        if HAS_KV_SCALES:
            rows = rows / tl.load(kv_scales_ptr + which)
        rows = tl.minimum(tl.maximum(rows, -448.0), 448.0)  # reference.FP8_MAX
        if ROUND_IN_FP32:
            # 3 mantissa bits: the grid step is 2^(exponent - 3), and 2^-9 among the subnormals
            magnitude = tl.abs(rows)
            step = tl.exp2(tl.floor(tl.log2(tl.maximum(magnitude, 0.015625))) - 3.0)
            magnitude = tl.floor(magnitude / step + 0.5) * step
            rows = tl.where(rows < 0, -magnitude, magnitude)
    return rows


def fp8_flags(key_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> dict:
    """The launch flags of :func:`as_cache_rows` for this cache. The Triton interpreter (CPU
    tensors) converts fp32 to fp8 by truncating, with a mantissa carry that can halve a value, so
    there the rows are rounded in fp32 first."""
    return dict(IS_FP8=key_cache.dtype == FP8_DTYPE, HAS_KV_SCALES=kv_scales is not None,
                ROUND_IN_FP32=key_cache.device.type == "cpu")


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, kv_scales_ptr,
    num_kv_heads, head_dim, block_size,
    key_stride_token, key_stride_head, key_stride_dim,
    value_stride_token, value_stride_head, value_stride_dim,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head, key_cache_stride_dim,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head, value_cache_stride_dim,
    IS_FP8: tl.constexpr, HAS_KV_SCALES: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
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
    key = as_cache_rows(key, kv_scales_ptr, 0, IS_FP8, HAS_KV_SCALES, ROUND_IN_FP32)
    value = as_cache_rows(value, kv_scales_ptr, 1, IS_FP8, HAS_KV_SCALES, ROUND_IN_FP32)
    tl.store(key_dest, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_dest, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Store ``[T, Hkv, D]`` keys and values at flat slots of ``[blocks, block_size, Hkv, D]`` caches;
    an fp8 cache gets them quantized with ``kv_scales`` as ``reference.write_kv_cache`` does.

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
        key, value, key_cache, value_cache, slot_mapping, kv_scales if kv_scales is not None else key,
        num_kv_heads, head_dim, key_cache.shape[1],
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps_for(block_h * block_d), **fp8_flags(key_cache, kv_scales),
    )
