"""CPU: ``x @ W.T + bias`` for llama.cpp block rows, the weight never copied out of its blocks.

- Up to ``gguf_cpu_native.MAX_ROWS`` (8) rows of ``x`` (decode steps, speculative verification):
  the C kernels' fused decode-and-dot GEMV (``gguf_cpu_native.py``), where a C compiler built them;
  else numba's (``gguf_numba.py``) for up to ``NUMBA_MAX_ROWS``, where numba is installed. Both
  decode each weight exactly (float32) and multiply it by ``x`` in float32.
- More rows: each call dequantizes a tile of ``W``'s rows (exactly: the C dequantizer, else the
  reference decoders) into a scratch tile, casts it to ``x``'s dtype (as a dequantized-at-load
  weight would be), multiplies, and moves on, so memory holds one tile. The decoding is paid once
  per call, which batches of many rows amortise.

>>> gguf_linear(torch.randn(3, 256), quantize(torch.randn(8, 256), "Q8_0"), "Q8_0").shape
torch.Size([3, 8])
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gguf_cpu_native, gguf_numba
from .gguf_reference import block_format, dequantize

# Dequantized values per tile: 1 Mi float32 = 4 MiB (2 MiB once cast to bf16). Large enough that
# each tile's matmul runs near full speed on a prefill batch, small next to any weight worth keeping
# quantized.
TILE_ELEMENTS = 1 << 20
# The numba GEMV decodes the weight once per row of x; above this the tiled path's one decode wins.
NUMBA_MAX_ROWS = 2


def gguf_linear(x: torch.Tensor, data: torch.Tensor, quant_type: str, bias: torch.Tensor | None = None,
                tile_elements: int | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` and ``W`` as uint8 block rows ``data`` ``[N, row_bytes]``;
    ``tile_elements`` given: the tiled path with tiles of that many values, whatever ``M`` is."""
    fmt = block_format(quant_type)
    num_rows, num_columns = data.shape[0], fmt.num_columns(data.shape[1])
    if x.shape[-1] != num_columns:
        raise ValueError(f"x must have {num_columns} columns for this {quant_type} weight, got {tuple(x.shape)}")
    gemv_rows = x.dim() == 2 and tile_elements is None and x.shape[0] > 0
    if gemv_rows and x.shape[0] <= gguf_cpu_native.MAX_ROWS and gguf_cpu_native.available():
        out = gguf_cpu_native.gemv(x.float(), data, quant_type).to(x.dtype)
        return out if bias is None else out.add_(bias)
    if gemv_rows and gguf_numba.AVAILABLE and x.shape[0] <= NUMBA_MAX_ROWS:
        out = gguf_numba.gguf_gemv(x, data, quant_type).to(x.dtype)
        return out if bias is None else out.add_(bias)
    decode = gguf_cpu_native.dequantize if gguf_cpu_native.available() else dequantize
    rows_per_tile = max(1, (tile_elements or TILE_ELEMENTS) // num_columns)
    if rows_per_tile >= num_rows:
        return F.linear(x, decode(data, quant_type).to(x.dtype), bias)
    out = torch.empty(*x.shape[:-1], num_rows, dtype=x.dtype, device=x.device)
    for start in range(0, num_rows, rows_per_tile):
        rows = data[start:start + rows_per_tile]
        tile_bias = None if bias is None else bias[start:start + rows.shape[0]]
        out[..., start:start + rows.shape[0]] = F.linear(x, decode(rows, quant_type).to(x.dtype), tile_bias)
    return out


def gguf_linear_routine(runs, bias: torch.Tensor | None = None):
    """``routine(x)`` = ``x @ W.T + bias`` for a weight made of row runs ``[(quant_type, data), ...]``
    (their outputs joined in order), with decode-sized steps bound straight to the C GEMV: one
    call per run and no dispatch (a decode step runs ~100 of these). None where the C kernels are
    not built here."""
    if not gguf_cpu_native.available():
        return None
    gemvs = [gguf_cpu_native.gemv_routine(data, quant_type) for quant_type, data in runs]
    max_rows = gguf_cpu_native.MAX_ROWS

    def routine(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if 0 < flat.shape[0] <= max_rows:
            x32 = flat.float().contiguous()
            out = gemvs[0](x32) if len(gemvs) == 1 else torch.cat([gemv(x32) for gemv in gemvs], dim=-1)
            out = out.to(x.dtype)
            if bias is not None:
                out = out.add_(bias)
        else:
            outs = [gguf_linear(flat, data, quant_type) for quant_type, data in runs]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            if bias is not None:
                out = out.add_(bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return routine
