"""CPU: the MLP activations, the gate's activation multiplied in place."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference


def silu_and_mul(x):
    """As :func:`reference.silu_and_mul`."""
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
