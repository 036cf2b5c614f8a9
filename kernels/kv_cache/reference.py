"""Plain torch: store new keys and values at flat slots of the paged KV cache."""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Store new keys/values ``[T, Hkv, D]`` at flat slots of a paged cache ``[blocks, block_size, Hkv, D]``.

    An fp8 (``float8_e4m3fn``) cache stores ``key / kv_scales[0]`` and ``value / kv_scales[1]``
    (scales of 1 when ``kv_scales`` is None), saturated to +-448, rounded to nearest.
    """
    for rows, cache, which in ((key, key_cache, 0), (value, value_cache, 1)):
        _slots(cache, rows.shape).index_copy_(0, slot_mapping, _as_stored(to_cache_dtype(rows, cache, kv_scales, which)))


def _slots(cache: torch.Tensor, row_shape: torch.Size) -> torch.Tensor:
    # index_copy_ has no fp8 kernel: fp8 bytes are copied as uint8
    return _as_stored(cache).view(-1, row_shape[1], row_shape[2])


def _as_stored(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor


def to_cache_dtype(rows: torch.Tensor, cache: torch.Tensor, kv_scales: torch.Tensor | None, which: int) -> torch.Tensor:
    """``rows`` as the cache stores them: quantized with ``kv_scales[which]`` for an fp8 cache."""
    if cache.dtype != FP8_DTYPE:
        return rows.to(cache.dtype)
    scaled = rows.to(torch.float32) if kv_scales is None else rows.to(torch.float32) / kv_scales[which]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
