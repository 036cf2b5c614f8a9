"""Matmuls of a few rows (batch-size-1 decode) with the elementwise op before them fused in:
``x @ W.T`` of RMSNorm(x + residual) or of SwiGLU(x); ``reference.py``, ``triton_gemv.py``.

A decode step of one sequence is bound by kernel launches as much as by weight reads; folding the
norm and the activation into the matmuls that read their outputs removes three launches a layer.
Callers (``engine/models/fused_decode.py``) use the Triton kernels on CUDA only and the unfused ops
elsewhere, which are also the reference.
"""

from . import reference  # noqa: F401
