"""CPU: ``x @ W.T`` for a few rows of ``x`` straight from block rows (GGUF's, W4G128), compiled by numba.

Decode steps multiply a handful of rows by the whole weight, so their cost is reading and decoding
the weight once. Here one fused loop per format decodes each weight with the operations of
``gguf_reference`` and accumulates its product with ``x`` in float32; LLVM may reassociate those
products and sums (``reassoc``: what lets it vectorize; no FMA contraction), so results agree with
the reference to float32 rounding (~1e-7 relative), as any GEMV's summation order does. Output rows
run in parallel (numba's OpenMP layer where it exists, else one thread: its default work queue
aborts when two Python threads launch kernels at once).

numba is optional (``pip install hearth-llm[quant-cpu]``): :data:`AVAILABLE` says whether it is
installed; ``gguf_cpu`` falls back to its tiled torch path without it. The kernels live in
``gguf_numba_kernels.py``, imported on the first call (which also sets ``OMP_WAIT_POLICY=PASSIVE``
for numba's OpenMP pool unless set: spinning idle threads of two OpenMP runtimes starve each
other). The first call of a process compiles every format at once (10-30 s on 2 busy cores;
cached on disk in ``__pycache__`` after that).

>>> out = gguf_gemv(x_rows, data, "Q4_K")        # float32 [M, N]
"""
from __future__ import annotations

import importlib.util

import numpy as np
import torch

from .gguf_reference import block_format

AVAILABLE = importlib.util.find_spec("numba") is not None
QTYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7, "W4G128": 8}
# float16 bits -> float32, exact: numba has no float16 type.
_F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


def gguf_gemv(x: torch.Tensor, data: torch.Tensor, quant_type: str) -> torch.Tensor:
    """float32 ``x @ W.T`` for ``x`` ``[M, K]`` (any float dtype; read as float32) and uint8 block
    rows ``data`` ``[N, row_bytes]``; meant for small ``M``."""
    if not AVAILABLE:
        raise RuntimeError("numba is not installed (pip install hearth-llm[quant-cpu])")
    block_format(quant_type)  # ValueError naming the supported types
    from . import gguf_numba_kernels as kernels

    x32 = x.detach().float().contiguous().numpy()
    out = np.empty((x32.shape[0], data.shape[0]), dtype=np.float32)
    if kernels.PARALLEL:
        kernels.numba.set_num_threads(max(1, min(torch.get_num_threads(), kernels.numba.config.NUMBA_NUM_THREADS)))
    kernels._gemv(x32, data.contiguous().numpy(), QTYPE_IDS[quant_type], _F16_TABLE, out)
    return torch.from_numpy(out)
