"""MLP activations: SwiGLU (``silu_and_mul``), GeGLU (``gelu_and_mul``) and GELU:
``reference.py``, ``cpu.py``, ``triton_activation.py``.

Callers use ``hearth_llm.kernels``, which picks the routine for the tensors' device.
"""

from . import cpu, reference  # noqa: F401  (kernels dispatches to op.cpu and op.reference)
