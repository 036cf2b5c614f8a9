"""CPU: ``x @ W.T + bias`` for llama.cpp block rows, the weight never copied out of its blocks.

- Up to ``NUMBA_MAX_ROWS`` rows of ``x`` (decode steps): numba's fused decode-and-dot GEMV
  (``gguf_numba.py``), where numba is installed.
- More rows, or without numba: each call dequantizes a tile of ``W``'s rows (exactly, by the
  reference decoders) into a scratch tile that stays in cache, casts it to ``x``'s dtype (as a
  dequantized-at-load weight would be), multiplies, and moves on, so memory holds one tile. The
  decoding is paid once per call, which batches of many rows amortise.

>>> gguf_linear(torch.randn(3, 256), quantize(torch.randn(8, 256), "Q8_0"), "Q8_0").shape
torch.Size([3, 8])
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gguf_numba
from .gguf_reference import block_format, dequantize

# Dequantized values per tile: 256 Ki float32 = 1 MiB, within a core's L2.
TILE_ELEMENTS = 1 << 18
# The numba GEMV decodes the weight once per row of x; above this the tiled path's one decode wins.
NUMBA_MAX_ROWS = 2


def gguf_linear(x: torch.Tensor, data: torch.Tensor, quant_type: str, bias: torch.Tensor | None = None,
                tile_elements: int = TILE_ELEMENTS) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` and ``W`` as uint8 block rows ``data`` ``[N, row_bytes]``."""
    fmt = block_format(quant_type)
    num_rows, num_columns = data.shape[0], fmt.num_columns(data.shape[1])
    if x.shape[-1] != num_columns:
        raise ValueError(f"x must have {num_columns} columns for this {quant_type} weight, got {tuple(x.shape)}")
    if gguf_numba.AVAILABLE and x.dim() == 2 and x.shape[0] <= NUMBA_MAX_ROWS:
        out = gguf_numba.gguf_gemv(x, data, quant_type).to(x.dtype)
        return out if bias is None else out.add_(bias)
    rows_per_tile = max(1, tile_elements // num_columns)
    if rows_per_tile >= num_rows:
        return F.linear(x, dequantize(data, quant_type).to(x.dtype), bias)
    out = torch.empty(*x.shape[:-1], num_rows, dtype=x.dtype, device=x.device)
    for start in range(0, num_rows, rows_per_tile):
        rows = data[start:start + rows_per_tile]
        tile_bias = None if bias is None else bias[start:start + rows.shape[0]]
        out[..., start:start + rows.shape[0]] = F.linear(x, dequantize(rows, quant_type).to(x.dtype), tile_bias)
    return out
