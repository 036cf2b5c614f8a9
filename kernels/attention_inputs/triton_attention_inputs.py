"""Triton: a layer's attention inputs in one launch (split heads, q/k RMSNorm, rotary, cache write).

Its reference is the composition of the single ops (``reference.py`` here).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_cache.triton_kv_cache import as_cache_rows, fp8_flags
from ..triton_utils import next_power_of_2, warps_for


@triton.jit
def _norm_and_rotate_heads(
    first, second, norm_weight_ptr, cos, sin, pairs, pair_mask, half_dim, eps,
    HAS_NORM: tl.constexpr, STORAGE: tl.constexpr,
):
    """RMS-norm each row of ``[heads, D]`` (held as its two halves) and rotate it, rounding to
    the storage dtype where the unfused kernels store their outputs."""
    if HAS_NORM:
        inverse_rms = tl.rsqrt((tl.sum(first * first, 1) + tl.sum(second * second, 1)) / (2 * half_dim) + eps)
        weight_first = tl.load(norm_weight_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)
        weight_second = tl.load(norm_weight_ptr + half_dim + pairs, mask=pair_mask, other=0.0).to(tl.float32)
        first = (first * inverse_rms[:, None]).to(STORAGE).to(tl.float32) * weight_first[None, :]
        second = (second * inverse_rms[:, None]).to(STORAGE).to(tl.float32) * weight_second[None, :]
        first = first.to(STORAGE).to(tl.float32)
        second = second.to(STORAGE).to(tl.float32)
    out_first = first * cos[None, :] - second * sin[None, :]
    out_second = second * cos[None, :] + first * sin[None, :]
    return out_first.to(STORAGE), out_second.to(STORAGE)


@triton.jit
def _qk_norm_rope_and_cache_kernel(
    query_out_ptr, qkv_ptr, positions_ptr, cos_sin_cache_ptr, q_norm_weight_ptr, k_norm_weight_ptr,
    key_cache_ptr, value_cache_ptr, slot_mapping_ptr, kv_scales_ptr,
    num_heads, num_kv_heads, half_dim, block_size, eps,
    qkv_stride_token, query_out_stride_token, cache_stride_position,
    key_cache_stride_block, key_cache_stride_slot, key_cache_stride_head,
    value_cache_stride_block, value_cache_stride_slot, value_cache_stride_head,
    HAS_QK_NORM: tl.constexpr, IS_FP8: tl.constexpr, HAS_KV_SCALES: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Per token: its query heads to ``query_out`` (program 0 of axis 1), its key and value heads to
    the cache (program 1); a one-token decode step's latency is then the longer of the two halves.
    ``USE_PDL``: launched early behind the qkv matmul, it reads the position's cos/sin (step inputs,
    written before the step) and waits for the matmul only before reading ``qkv``."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    head_dim = 2 * half_dim
    pairs = tl.arange(0, BLOCK_HALF)
    pair_mask = pairs < half_dim
    cos = tl.load(cos_sin_cache_ptr + position * cache_stride_position + pairs, mask=pair_mask).to(tl.float32)
    sin = tl.load(cos_sin_cache_ptr + position * cache_stride_position + half_dim + pairs,
                  mask=pair_mask).to(tl.float32)
    storage = qkv_ptr.dtype.element_ty
    row = qkv_ptr + token * qkv_stride_token
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

    # Two programs per token, in parallel: its query heads (part 0), its key and value heads (part 1).
    if tl.program_id(1) == 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < num_heads) & pair_mask[None, :]
        first = tl.load(row + heads * head_dim + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        second = tl.load(row + heads * head_dim + half_dim + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        first, second = _norm_and_rotate_heads(first, second, q_norm_weight_ptr, cos, sin, pairs, pair_mask, half_dim,
                                               eps, HAS_NORM=HAS_QK_NORM, STORAGE=storage)
        out = query_out_ptr + token * query_out_stride_token + heads * head_dim + pairs[None, :]
        tl.store(out, first.to(query_out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + half_dim, second.to(query_out_ptr.dtype.element_ty), mask=mask)
    else:
        # A slot of -1 marks a padding token of a CUDA-graph batch: it owns no cache slot.
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            block = slot // block_size
            slot_in_block = slot % block_size
            kv_heads = tl.arange(0, BLOCK_KV)[:, None]
            kv_mask = (kv_heads < num_kv_heads) & pair_mask[None, :]
            key_row = row + num_heads * head_dim + kv_heads * head_dim + pairs[None, :]
            key_first = tl.load(key_row, mask=kv_mask, other=0.0).to(tl.float32)
            key_second = tl.load(key_row + half_dim, mask=kv_mask, other=0.0).to(tl.float32)
            key_first, key_second = _norm_and_rotate_heads(key_first, key_second, k_norm_weight_ptr, cos, sin, pairs,
                                                           pair_mask, half_dim, eps, HAS_NORM=HAS_QK_NORM, STORAGE=storage)
            key_dest = (key_cache_ptr + block * key_cache_stride_block + slot_in_block * key_cache_stride_slot
                        + kv_heads * key_cache_stride_head + pairs[None, :])
            key_first = as_cache_rows(key_first, kv_scales_ptr, 0, IS_FP8, HAS_KV_SCALES, ROUND_IN_FP32)
            key_second = as_cache_rows(key_second, kv_scales_ptr, 0, IS_FP8, HAS_KV_SCALES, ROUND_IN_FP32)
            tl.store(key_dest, key_first.to(key_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(key_dest + half_dim, key_second.to(key_cache_ptr.dtype.element_ty), mask=kv_mask)
            value_row = row + (num_heads + num_kv_heads) * head_dim + kv_heads * head_dim + pairs[None, :]
            value_dest = (value_cache_ptr + block * value_cache_stride_block + slot_in_block * value_cache_stride_slot
                          + kv_heads * value_cache_stride_head + pairs[None, :])
            value_first = as_cache_rows(tl.load(value_row, mask=kv_mask), kv_scales_ptr, 1, IS_FP8, HAS_KV_SCALES,
                                        ROUND_IN_FP32)
            value_second = as_cache_rows(tl.load(value_row + half_dim, mask=kv_mask), kv_scales_ptr, 1, IS_FP8,
                                         HAS_KV_SCALES, ROUND_IN_FP32)
            tl.store(value_dest, value_first.to(value_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(value_dest + half_dim, value_second.to(value_cache_ptr.dtype.element_ty), mask=kv_mask)


def supports_fused_rotary(head_dim: int, rotary_dim: int, is_neox_style: bool) -> bool:
    """Whether :func:`qk_norm_rope_and_cache` handles this rotary layout."""
    return is_neox_style and rotary_dim == head_dim


def qk_norm_rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    is_neox_style: bool = True,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels.qk_norm_rope_and_cache`` in one launch (the unfused path takes five to seven);
    an fp8 cache gets the keys and values quantized as ``kv_cache.reference.write_kv_cache`` does.

    Full-width NeoX rotary only (``supports_fused_rotary``); ``kernels.qk_norm_rope_and_cache``
    sends partial and GPT-J style rotary to the unfused ops.
    """
    num_tokens = qkv.shape[0]
    head_dim = key_cache.shape[-1]
    if qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"qkv must be [T, ({num_heads} + 2 * {num_kv_heads}) * {head_dim}] with an even head_dim, "
                         f"got {tuple(qkv.shape)}")
    if not supports_fused_rotary(head_dim, cos_sin_cache.shape[-1], is_neox_style):
        raise ValueError(f"the fused kernel rotates whole heads NeoX style: cos_sin_cache must be [max_position, "
                         f"{head_dim}] and is_neox_style True; got width {cos_sin_cache.shape[-1]} and "
                         f"is_neox_style={is_neox_style}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must be given together")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache must be contiguous in their last dimension")
    query = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return query
    has_norm = q_norm_weight is not None
    block_h, block_half = next_power_of_2(num_heads), next_power_of_2(head_dim // 2)
    _qk_norm_rope_and_cache_kernel[(num_tokens, 2)](
        query, qkv, positions, cos_sin_cache,
        q_norm_weight.contiguous() if has_norm else qkv, k_norm_weight.contiguous() if has_norm else qkv,
        key_cache, value_cache, slot_mapping, kv_scales if kv_scales is not None else qkv,
        num_heads, num_kv_heads, head_dim // 2, key_cache.shape[1], eps,
        qkv.stride(0), query.stride(0), cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HAS_QK_NORM=has_norm, **fp8_flags(key_cache, kv_scales), BLOCK_H=block_h, BLOCK_KV=next_power_of_2(num_kv_heads), BLOCK_HALF=block_half,
        num_warps=warps_for(2 * block_h * block_half), **_pdl_launch(qkv),
    )
    return query


def _pdl_launch(qkv: torch.Tensor) -> dict:
    """Programmatic dependent launch where the bs1 GEMVs use it (``kernels/gemv``): both or neither."""
    from ..gemv.triton_gemv import uses_pdl

    return {"USE_PDL": True, "launch_pdl": True} if uses_pdl(qkv) else {}
