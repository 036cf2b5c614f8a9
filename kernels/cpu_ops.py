"""Every op's CPU routine under one name (each lives in its op's ``cpu.py``), and the CPU weight
formats' matmuls (``matmul/cpu.py``).

>>> import torch
>>> from hearth_llm.kernels import cpu_ops
>>> normed, summed = cpu_ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

from .activation.cpu import gelu, gelu_and_mul, silu_and_mul
from .attention.cpu import paged_attention
from .kv_cache.cpu import write_kv_cache
from .matmul.cpu import (INT4_GROUP_SIZE, dense_linear, fp16_linear, has_onednn_bf16, int4_linear,
                         int4_or_dense_linear_routine, int4_weight_if_lossless, pack_dense_weight, pack_fp16_weight)
from .norm.cpu import layer_norm, rms_norm
from .rotary.cpu import rotary_embedding
from .sampling.cpu import argmax, topk_indices

__all__ = ["INT4_GROUP_SIZE", "argmax", "release_freed_heap", "dense_linear", "fp16_linear", "gelu", "gelu_and_mul", "has_onednn_bf16",
           "int4_linear", "int4_or_dense_linear_routine", "int4_weight_if_lossless", "layer_norm", "pack_dense_weight", "pack_fp16_weight",
           "paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "topk_indices", "write_kv_cache"]


def release_freed_heap() -> bool:
    """Hand the heap pages freed so far back to the OS (glibc's ``malloc_trim(0)``); False where the C
    library has none. A load's temporaries (each checkpoint tensor read, then copied into its layer) are
    freed between long-lived allocations, so glibc keeps their pages: measured on a 644 MiB Q4_K_M file
    (1B Llama, bf16, blocks kept), RSS 1106 -> 985 MiB right after loading. Call once after a load."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None
