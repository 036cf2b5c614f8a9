"""CPU: the paged-cache write of ``reference.py`` without its conversions, and with one slice copy
for a fresh prefill's consecutive slots."""
from __future__ import annotations

import torch

from ..step_memo import memo as _memo
from . import reference

# From this many new tokens on, a write to one consecutive run of slots is a slice copy: index_copy_
# costs ~23 us for 500 tokens against ~8 us for the copy, while for a few tokens the once-per-step
# check would cost more than it saves.
_MIN_TOKENS_FOR_SLICE_WRITE = 64


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_scales=None) -> None:
    """As :func:`reference.write_kv_cache`, without its conversions when the dtypes already match."""
    if key_cache.dtype == reference.FP8_DTYPE:  # the engine keeps no fp8 cache on the CPU; tests may
        return reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_scales)
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.dtype != key_cache.dtype:
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    key_slots, value_slots = key_cache.view(-1, num_kv_heads, head_dim), value_cache.view(-1, num_kv_heads, head_dim)
    first_slot = _first_slot_of_one_run(slot_mapping) if num_tokens >= _MIN_TOKENS_FOR_SLICE_WRITE else None
    if first_slot is None:
        key_slots.index_copy_(0, slot_mapping, key)
        value_slots.index_copy_(0, slot_mapping, value)
    else:
        key_slots.narrow(0, first_slot, num_tokens).copy_(key)
        value_slots.narrow(0, first_slot, num_tokens).copy_(value)


def _first_slot_of_one_run(slot_mapping: torch.Tensor) -> int | None:
    """The first slot when the slots are consecutive (a fresh prefill in consecutive blocks), else
    None; read on the host once per step, as this path only ever sees CPU tensors."""
    def compute():
        slots = slot_mapping.tolist()
        return slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None

    return _memo.get("first_slot_of_one_run", (slot_mapping,), compute)
