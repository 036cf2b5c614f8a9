"""The linear op, ``x @ W.T + bias``: weight formats (``formats.py``), the plain torch routine
(``reference.py``) and the CPU routines for repacked weights (``cpu.py``). (Named ``matmul`` so the
package does not shadow the function ``kernels.linear``.)

``kernels.linear(x, weight, bias)`` picks the routine by the weight's format and the input's device.
"""
from __future__ import annotations

from . import cpu, reference  # noqa: F401
from .formats import DenseWeight, Fp16Weight, Int4Weight, OnednnBf16Weight

__all__ = ["DenseWeight", "Fp16Weight", "Int4Weight", "OnednnBf16Weight"]
