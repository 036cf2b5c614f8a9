"""CPU: ``x @ W.T + bias`` for llama.cpp block rows, dequantizing a few rows of ``W`` at a time.

The weight stays in its file's bytes; each call dequantizes ``rows_per_chunk`` rows (exactly, by
the reference decoders) into a scratch tile that stays in cache, multiplies, and moves on, so no
dense copy of the weight ever exists (memory: one tile). The tile is cast to ``x``'s dtype before
the matmul, as a dequantized-at-load weight would be.

This is the plain, exact baseline: every call re-decodes the whole weight, which costs far more
than the matmul for decode steps of a few rows (see the numbers in the module's tests/report);
large batches amortise it.

>>> gguf_linear(torch.randn(3, 256), quantize(torch.randn(8, 256), "Q8_0"), "Q8_0").shape
torch.Size([3, 8])
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .gguf_reference import block_format, dequantize

# Dequantized values per tile: 256 Ki float32 = 1 MiB, within a core's L2.
TILE_ELEMENTS = 1 << 18


def gguf_linear(x: torch.Tensor, data: torch.Tensor, quant_type: str, bias: torch.Tensor | None = None,
                tile_elements: int = TILE_ELEMENTS) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` and ``W`` as uint8 block rows ``data`` ``[N, row_bytes]``."""
    fmt = block_format(quant_type)
    num_rows, num_columns = data.shape[0], fmt.num_columns(data.shape[1])
    if x.shape[-1] != num_columns:
        raise ValueError(f"x must have {num_columns} columns for this {quant_type} weight, got {tuple(x.shape)}")
    rows_per_tile = max(1, tile_elements // num_columns)
    if rows_per_tile >= num_rows:
        return F.linear(x, dequantize(data, quant_type).to(x.dtype), bias)
    out = torch.empty(*x.shape[:-1], num_rows, dtype=x.dtype, device=x.device)
    for start in range(0, num_rows, rows_per_tile):
        rows = data[start:start + rows_per_tile]
        tile_bias = None if bias is None else bias[start:start + rows.shape[0]]
        out[..., start:start + rows.shape[0]] = F.linear(x, dequantize(rows, quant_type).to(x.dtype), tile_bias)
    return out
