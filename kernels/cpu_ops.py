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
import mmap
import sys

from .activation.cpu import gelu, gelu_and_mul, silu_and_mul
from .attention.cpu import paged_attention
from .kv_cache.cpu import write_kv_cache
from .matmul.cpu import (INT4_GROUP_SIZE, dense_linear, fp16_linear, has_onednn_bf16, int4_linear,
                         int4_or_dense_linear_routine, int4_weight_if_lossless, pack_dense_weight, pack_fp16_weight)
from .norm.cpu import layer_norm, rms_norm
from .rotary.cpu import rotary_embedding
from .sampling.cpu import argmax, topk_indices

__all__ = ["INT4_GROUP_SIZE", "argmax", "release_freed_heap", "no_huge_pages", "dense_linear", "fp16_linear", "gelu", "gelu_and_mul", "has_onednn_bf16",
           "int4_linear", "int4_or_dense_linear_routine", "int4_weight_if_lossless", "layer_norm", "pack_dense_weight", "pack_fp16_weight",
           "paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "topk_indices", "write_kv_cache"]


def release_freed_heap() -> bool:
    """Hand the heap pages freed so far back to the OS (glibc's ``malloc_trim(0)``); False where the C
    library has none. A load's temporaries (each checkpoint tensor read, then copied into its layer) are
    freed between long-lived allocations, so glibc keeps their pages: measured on a 644 MiB Q4_K_M file
    (1B Llama, bf16, blocks kept), RSS 1106 -> 985 MiB right after loading. Call once after a load."""
    trim = _libc_function("malloc_trim", (ctypes.c_size_t,))
    return trim is not None and bool(trim(0))


MADV_NOHUGEPAGE = 15  # Linux


def no_huge_pages(tensor) -> bool:
    """``madvise(MADV_NOHUGEPAGE)`` over the whole pages of a CPU tensor's bytes, so the first write into
    them makes one page resident, not a 2 MiB transparent huge page (numpy asks for those on large
    arrays); False where the C library has no madvise (not Linux) or it fails.

    >>> import numpy as np, torch
    >>> pool = torch.from_numpy(np.zeros(1 << 22, dtype=np.int16))
    >>> no_huge_pages(pool) in (True, False)
    True
    """
    madvise = _libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    address, num_bytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    length = (address + num_bytes - start) // mmap.PAGESIZE * mmap.PAGESIZE
    if madvise is None or length <= 0 or not sys.platform.startswith("linux"):
        return False
    return madvise(start, length, MADV_NOHUGEPAGE) == 0


@functools.cache
def _libc_function(name: str, argtypes: tuple):
    """The C library's function ``name`` (int result), or None where there is no such library or function."""
    library = ctypes.util.find_library("c")
    try:
        function = getattr(ctypes.CDLL(library), name, None) if library else None
    except OSError:
        return None
    if function is not None:
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return function
