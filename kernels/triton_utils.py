"""What the Triton kernels of every op share: launch-size helpers and device functions.

Importing it needs Triton, not a GPU.
"""
from __future__ import annotations

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
