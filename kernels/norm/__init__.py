"""RMSNorm and LayerNorm of ``x + residual`` (returning the sum for the next residual):
``reference.py``, ``cpu.py``, ``triton_norm.py``.

Callers use ``hearth_llm.kernels``, which picks the routine for the tensors' device.
"""

from . import cpu, reference  # noqa: F401  (kernels dispatches to op.cpu and op.reference)
