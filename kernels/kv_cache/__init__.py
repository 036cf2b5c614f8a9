"""Writing new keys and values into the paged KV cache: ``reference.py``, ``cpu.py``,
``triton_kv_cache.py``.

Callers use ``hearth_llm.kernels``, which picks the routine for the tensors' device.
"""

from . import cpu, reference  # noqa: F401  (kernels dispatches to op.cpu and op.reference)
