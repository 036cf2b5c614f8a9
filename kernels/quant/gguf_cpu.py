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

# Dequantized values per tile: 4 Mi (8 MiB in bf16), small next to any weight worth keeping quantized.
# Each tile is a oneDNN call, and smaller tiles cost more calls: 500 rows x [16384, 2048] Q4_K, CPU ms
# (1 / 2 threads, shared cores): 1 Mi 156 / 282, 2 Mi 145 / 294, 4 Mi 57-114 / 149-237, 8 Mi 87-134 / 114-145.
TILE_ELEMENTS = 1 << 22
# The bf16 kernels (Q8_0, Q4_K, Q6_K) win at every row count since all their rows run in one pass over
# the blocks (1 thread, [8192, 2048] hot, EPYC Zen 4, ms, bf16 / float32: Q4_K 0.76 / 1.07 at 1 row,
# 0.99 / 1.51 at 2, 1.86 / 2.79 at 5, 3.70 / 5.56 at 8; Q6_K 0.95 / 2.53, 1.21 / 2.95, 2.13 / 3.54,
# 3.47 / 6.20; Q8_0 0.97 / 0.98, 1.21 / 1.49, 2.12 / 2.99, 4.18 / 5.72), and they keep the same
# accumulators for any row count, so a verify step's rows get a one-row step's bits (the float32 GEMV
# keeps fewer for more rows).
BF16_MAX_ROWS = 8
# Q4_0/Q4_1's bf16 kernels (four blocks per step, x laid out once per call) beat their float32 ones at
# every row count: the bundled SmolLM2's 210 Q4_1 matrices, 1 thread, CPU ms per pass, bf16 / float32:
# 8.67 / 10.42 at 1 row, 11.03 / 12.36 at 2, 18.83 / 23.73 at 4, 24.33 / 31.45 at 5, 34.04 / 44.02 at 8.
BF16_MAX_ROWS_BY_TYPE = {"Q4_0": 8, "Q4_1": 8}
# float32 batches of up to this many rows run the vectorized GEMV in passes of MAX_ROWS rows (each row the
# bits it has alone), more a decoded tile. AVX2 build, 1 thread, [4096, 2048], ms, passes / tiles: Q4_K 11.8 /
# 12.8 at 16 rows, 18.4 / 17.5 at 24; Q6_K 15.7 / 17.1 at 16, 20.9 / 14.4 at 24 (noisy).
FLOAT32_PASS_MAX_ROWS = 16
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
        if (x.dtype == torch.bfloat16 and x.shape[0] <= BF16_MAX_ROWS_BY_TYPE.get(quant_type, BF16_MAX_ROWS)
                and gguf_cpu_native.has_bf16(quant_type)):
            out = gguf_cpu_native.gemv_bf16(x, data, quant_type).to(x.dtype)
        else:
            out = gguf_cpu_native.gemv(x.float(), data, quant_type).to(x.dtype)
        return out if bias is None else out.add_(bias)
    if (gemv_rows and x.dtype == torch.float32 and gguf_cpu_native.MAX_ROWS < x.shape[0] <= FLOAT32_PASS_MAX_ROWS
            and gguf_cpu_native.has_vector_float32(quant_type)):
        # a few more rows than a GEMV takes (float32 batched decode): passes of the GEMV beat a decoded tile
        step = gguf_cpu_native.MAX_ROWS
        out = torch.cat([gguf_cpu_native.gemv(x[start:start + step], data, quant_type)
                         for start in range(0, x.shape[0], step)])
        return out if bias is None else out.add_(bias)
    if gemv_rows and gguf_numba.AVAILABLE and x.shape[0] <= NUMBA_MAX_ROWS:
        out = gguf_numba.gguf_gemv(x, data, quant_type).to(x.dtype)
        return out if bias is None else out.add_(bias)
    decode = _tile_decoder(x.dtype)
    rows_per_tile = max(1, (tile_elements or TILE_ELEMENTS) // num_columns)
    if rows_per_tile >= num_rows:
        return F.linear(x, decode(data, quant_type).to(x.dtype), bias)
    out = torch.empty(*x.shape[:-1], num_rows, dtype=x.dtype, device=x.device)
    for start in range(0, num_rows, rows_per_tile):
        rows = data[start:start + rows_per_tile]
        tile_bias = None if bias is None else bias[start:start + rows.shape[0]]
        out[..., start:start + rows.shape[0]] = F.linear(x, decode(rows, quant_type).to(x.dtype), tile_bias)
    return out


def _tile_decoder(dtype: torch.dtype):
    """``(data, quant_type) -> tile``: the C dequantizer (straight to bf16 for bf16 batches: half the
    bytes, no cast pass; the same values as ``.to(torch.bfloat16)``), else the reference decoders."""
    if not gguf_cpu_native.available():
        return dequantize
    if dtype == torch.bfloat16:
        return _bf16_or_float32_tile
    return lambda data, quant_type: gguf_cpu_native.dequantize(data, quant_type, num_threads=1)


def _bf16_or_float32_tile(data: torch.Tensor, quant_type: str) -> torch.Tensor:
    # One thread per tile: a batch runs ~1000 tiles, and a parallel region per tile waits at its
    # barrier for the slowest thread each time (measured on 2 shared cores: prefill 3x slower at 2
    # threads than at 1); the tile's matmul is the parallel part.
    tile = gguf_cpu_native.dequantize_bf16(data, quant_type, num_threads=1)
    return gguf_cpu_native.dequantize(data, quant_type, num_threads=1) if tile is None else tile


def step_runs(runs, dtype: torch.dtype):
    """``runs`` as ``cpu_step_native.StepRun`` s where :func:`gguf_linear_routine` multiplies steps of 1..8
    rows of ``dtype`` by one C GEMV per run into its columns: float32, or bf16 with every run's type on a
    bf16-out kernel; else None (no C kernels, or a bf16 step that mixes in float32 kernels).

    >>> step_runs([("Q4_K", blocks), ("Q6_K", more_blocks)], torch.bfloat16)   # [StepRun(...), StepRun(...)]
    """
    from ..cpu_step_native import StepRun

    if not runs or not gguf_cpu_native.available():
        return None
    if dtype == torch.bfloat16:
        if not all(quant_type in gguf_cpu_native.BF16_OUT_TYPES and gguf_cpu_native.has_bf16(quant_type)
                   and BF16_MAX_ROWS_BY_TYPE.get(quant_type, BF16_MAX_ROWS) >= gguf_cpu_native.MAX_ROWS
                   for quant_type, _ in runs):
            return None
    elif dtype != torch.float32:
        return None
    return [StepRun(quant_type, data) for quant_type, data in runs]


def gguf_linear_routine(runs, bias: torch.Tensor | None = None):
    """``routine(x)`` = ``x @ W.T + bias`` for a weight made of row runs ``[(quant_type, data), ...]``
    (their outputs joined in order), with decode-sized steps bound straight to the C GEMVs: one
    call per run and no dispatch (a decode step runs ~100 of these). bf16 ``x`` goes to the bf16
    kernels where the type has one (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), else is read as float32. None where the C kernels
    are not built here."""
    if not gguf_cpu_native.available():
        return None
    fp32 = [gguf_cpu_native.gemv_routine(data, quant_type) for quant_type, data in runs]
    bf16 = [gguf_cpu_native.gemv_routine(data, quant_type, bf16=True) if gguf_cpu_native.has_bf16(quant_type)
            else None for quant_type, data in runs]
    bf16_max_rows = [BF16_MAX_ROWS_BY_TYPE.get(quant_type, BF16_MAX_ROWS) for quant_type, _ in runs]
    max_rows = gguf_cpu_native.MAX_ROWS
    # bf16 x with every run on a bf16 kernel (the AVX-512 BF16 path's decode steps): bf16 out from the kernels,
    # each run's columns written in place (the float32 sums rounded to nearest even, as .to(bfloat16) rounds
    # them: the same bits, without a float32 output, a cast and a cat per call).
    to_bf16 = None
    if all(gemv16 is not None for gemv16 in bf16) and all(qt in gguf_cpu_native.BF16_OUT_TYPES for qt, _ in runs):
        to_bf16 = [(gguf_cpu_native.gemv_routine(data, quant_type, bf16_out=True), data.shape[0])
                   for quant_type, data in runs]
    num_outputs = sum(data.shape[0] for _, data in runs)
    most_bf16_rows = min(bf16_max_rows)

    def rows_out(flat: torch.Tensor) -> torch.Tensor:
        x32 = None
        outs = []
        for gemv32, gemv16, most in zip(fp32, bf16, bf16_max_rows):
            if gemv16 is not None and flat.dtype == torch.bfloat16 and flat.shape[0] <= most:
                outs.append(gemv16(flat.contiguous()))
            else:
                x32 = flat.float().contiguous() if x32 is None else x32
                outs.append(gemv32(x32))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def rows_in_bf16(flat: torch.Tensor) -> torch.Tensor:
        flat = flat.contiguous()
        if len(to_bf16) == 1:
            return to_bf16[0][0](flat)
        out = torch.empty(flat.shape[0], num_outputs, dtype=torch.bfloat16)
        start = 0
        for gemv, rows in to_bf16:
            gemv(flat, out=out[:, start:start + rows])
            start += rows
        return out

    def routine(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if to_bf16 is not None and x.dtype == torch.bfloat16 and 0 < flat.shape[0] <= most_bf16_rows:
            out = rows_in_bf16(flat)
        elif 0 < flat.shape[0] <= max_rows:
            out = rows_out(flat).to(x.dtype)
        else:
            outs = [gguf_linear(flat, data, quant_type) for quant_type, data in runs]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            out = out.add_(bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return routine
