"""Causal attention over the paged KV cache (prefill, extend and decode in one call), with
sliding windows, GQA and logit soft-capping: ``reference.py``, ``cpu.py``, ``triton_attention.py``.

Callers use ``hearth_llm.kernels``, which picks the routine for the tensors' device.
"""

from . import cpu, reference  # noqa: F401  (kernels dispatches to op.cpu and op.reference)
