"""What the Triton kernels of every op share: launch-size helpers and device functions.

Importing it needs Triton, not a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


def next_power_of_2(n: int) -> int:
    """The power of two at or above ``n`` (1 for n <= 1): Triton block sizes must be powers of two."""
    return triton.next_power_of_2(max(int(n), 1))


def warps_for(num_elements: int) -> int:
    """Enough warps that each thread holds a few vector loads of an elementwise row kernel."""
    return max(1, min(16, num_elements // 1024))


@triton.jit
def tanh(x):
    """tanh from exp (libdevice's tanh has no Triton-interpreter version); exact to float32
    rounding near 1 and +-1 at the extremes (exp overflows to inf, 2 / inf = 0)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


_SPLIT_K_BUFFERS: dict = {}


def split_k_buffers(device: torch.device, block_t: int, num_rows: int, num_tiles: int):
    """The zeroed float32 workspace ``[block_t, num_rows]`` and int32 tile counters of a split-K GEMV whose
    last program to finish a tile reduces it, one pair per (device, shape), kept: each call leaves them
    zero. ``(None, None)`` when first asked for inside a CUDA graph capture (the caller then runs unsplit).

    >>> workspace, counts = split_k_buffers(x.device, 16, num_rows, num_tiles)
    """
    key = (device, block_t, num_rows, num_tiles)
    if key not in _SPLIT_K_BUFFERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None, None
        _SPLIT_K_BUFFERS[key] = (torch.zeros(block_t, num_rows, dtype=torch.float32, device=device),
                                 torch.zeros(num_tiles, dtype=torch.int32, device=device))
    return _SPLIT_K_BUFFERS[key]
