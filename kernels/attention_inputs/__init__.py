"""A layer's attention inputs from its fused q/k/v projection in one step (split heads, q/k
RMSNorm, rotary, cache write): ``reference.py`` composes the single ops, ``triton_attention_inputs.py``
fuses them into one CUDA launch.

Callers use ``hearth_llm.kernels``, which picks the routine for the tensors' device.
"""

from . import reference  # noqa: F401
