"""Rotary position embedding of queries and keys (NeoX or GPT-J pairs, partial rotary):
``reference.py``, ``cpu.py``, ``triton_rotary.py``.

Callers use ``hearth_llm.kernels``, which picks the routine for the tensors' device.
"""

from . import cpu, reference  # noqa: F401  (kernels dispatches to op.cpu and op.reference)
