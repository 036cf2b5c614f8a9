"""CPU: the MLP activations, the gate's activation multiplied in place."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cpu_step_native
from . import reference

# Rows up to which the C kernel (one thread) takes SwiGLU; more go to torch, which may use every thread.
MAX_NATIVE_ROWS = 64


def silu_and_mul(x):
    """As :func:`reference.silu_and_mul`; a few contiguous 2-D rows in one C pass (``cpu_step_native``)."""
    if (x.dim() == 2 and x.shape[0] <= MAX_NATIVE_ROWS and cpu_step_native.supports_silu_and_mul(x)
            and cpu_step_native.available()):
        return cpu_step_native.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_and_mul(x, approximate="tanh"):
    """As :func:`reference.gelu_and_mul`."""
    reference.check_gelu_approximate(approximate)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate).mul_(up)


def gelu(x, approximate="tanh"):
    """As :func:`reference.gelu`."""
    return reference.gelu(x, approximate)
