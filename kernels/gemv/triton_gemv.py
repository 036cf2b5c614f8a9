"""Triton: ``x @ W.T`` for a few rows, with RMSNorm(x + residual) or SwiGLU(x) computed on the way
in; see ``reference.py``.

One program computes ``BLOCK_N`` outputs of one row over all of K: it walks K in ``BLOCK_K``
chunks, each a ``[BLOCK_N, BLOCK_K]`` tile of W (contiguous along K, so 16-byte loads) times the
row's chunk, summed across K only once at the end. The row's inputs are recomputed by every
program (a few KiB from L2), so the norm or the activation needs no launch of its own; the norm's
scale is one number per row, applied to the finished dot, so the row is read once. Every
program reads its whole W tile once per row: meant for 1 to a few rows, where the matmul is a
weight read (batch-size-1 decode). All arithmetic is fp32. On Hopper the kernels launch with
programmatic dependent launch (:data:`USE_PDL`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# PROLOGUE values: what the row is before it multiplies W.
PLAIN = 0       # x itself
RMS_NORM = 1    # RMSNorm(x + residual) * norm_weight (the sum rounded to x's dtype, the norm in fp32)
SILU_AND_MUL = 2  # silu(x[:K]) * x[K:2K], rounded as kernels.silu_and_mul stores it


@dataclass(frozen=True, slots=True)
class GemvLaunch:
    """Tile of one program (``block_n`` outputs, K walked ``block_k`` at a time) and its warps."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    # Load the next K tile before multiplying this one (two tiles of W in flight per program, twice
    # the registers for them).
    prefetch: bool = False
    # With programmatic dependent launch: load the first two K tiles before waiting for the previous
    # kernel, then keep two tiles ahead (three tiles' registers); bs1_decode's +pp variant A/Bs it.
    preload: bool = False


def default_launch(num_outputs: int, reduction: int, prologue: int = PLAIN, gated_out: bool = False) -> GemvLaunch:
    """The launch for an ``[num_outputs, reduction]`` weight and this prologue, from the H200 sweep at
    one row (bf16, 4 warps, µs per call in CUDA graphs; ``benchmarks/bs1_decode.py``, 2026-12-01):
    without a prologue narrow programs spread the weight over more programs (o_proj 1024x2048 3.4,
    4096x4096 10.8 with 2 outputs); SwiGLU sits between (down 1024x3072 4.9 with 4 outputs, K 2048).
    The RMSNorm prologue took 16 outputs when it read the row twice (Qwen3-0.6B qkv 5.4 / gate_up
    6.3, Llama-3-8B qkv 16.3, against 6.1 / 9.7 / 28.1 with 8). In one pass (H200 round 1,
    2026-12-02) 8 outputs run Qwen3-0.6B's qkv in 4.97 µs; Llama-3-8B's (K 4096) took 19.7 alone
    against 16.3 with 16 outputs, yet in the whole step 8 x 1024 beat 16 x 1024 (4.364 against 4.399
    ms/token), and 16 outputs in K tiles of 512 beat both (below; a 16 x 1024 tile takes 255
    registers, 2 programs an SM). A SwiGLU epilogue dots two weight rows per output: 4 outputs are
    8 rows (gate_up, round 1; 8 outputs or K tiles of 512 were slower in round 2)."""
    block_k = triton.next_power_of_2(reduction)
    if prologue == RMS_NORM and not gated_out and reduction >= 4096:
        # H200 round 2 (2026-12-02), Llama-3-8B bs1 step, qkv 6144x4096: 16 outputs in K tiles of 512
        # 4.179 ms/token against 4.286 with 8 x 1024 (8 x 512: 4.345, 4 x 1024: 4.251, 8 warps: 4.207).
        return GemvLaunch(block_n=16, block_k=512, num_warps=4)
    if prologue == RMS_NORM:
        block_n = 4 if gated_out else 8
        return GemvLaunch(block_n=block_n, block_k=min(1024, block_k), num_warps=4)
    if prologue == SILU_AND_MUL:
        return GemvLaunch(block_n=4, block_k=min(2048, block_k), num_warps=4)
    # An LM head (100k+ outputs) has programs enough at 8 outputs each; 2 would make ~10^5 tiny ones.
    return GemvLaunch(block_n=2 if num_outputs <= 16384 else 8, block_k=min(1024, block_k), num_warps=4)


@triton.jit
def _row_chunk(x_row_ptr, residual_row_ptr, summed_row_ptr, cols, col_mask, reduction, is_summed_writer,
               PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Columns ``cols`` of the row before any norm, in fp32: x, x + residual (stored once, as the
    next residual stream) or silu(gate) * up, each rounded to x's dtype as the unfused kernels store it."""
    storage = x_row_ptr.dtype.element_ty
    if PROLOGUE == 2:
        gate = tl.load(x_row_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        up = tl.load(x_row_ptr + reduction + cols, mask=col_mask, other=0.0).to(tl.float32)
        row = (gate * tl.sigmoid(gate) * up).to(storage).to(tl.float32)
    else:
        row = tl.load(x_row_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            residual = tl.load(residual_row_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            summed = (row + residual).to(storage)
            tl.store(summed_row_ptr + cols, summed, mask=col_mask & (tl.zeros_like(cols) + is_summed_writer != 0))
            row = summed.to(tl.float32)
    return row


@triton.jit
def _gemv_kernel(
    out_ptr, summed_ptr, x_ptr, residual_ptr, norm_weight_ptr, weight_ptr,
    num_outputs, reduction, eps,
    x_stride_row, residual_stride_row, summed_stride_row, out_stride_row, weight_stride_row,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, GATED_OUT: tl.constexpr, PRELOAD: tl.constexpr = False,
):
    """One program: outputs [pid * BLOCK_N, +BLOCK_N) of row ``program_id(1)``.

    RMSNorm is one pass: ``sum_k W[n, k] * norm_weight[k] * s[k]`` and ``sum_k s[k]^2`` of the
    summed row ``s`` accumulate together; the row's inverse RMS scales the dot at the end.

    With ``USE_PDL`` (programmatic dependent launch) the program starts while the kernel before it
    still runs: it lets the next kernel start too, loads its first weight tile (weights are not
    written by any kernel of the step), and only then waits for the previous kernel's results.

    ``GATED_OUT``: W is ``[2 * num_outputs, K]`` (gate rows, then up rows) and output ``n`` is
    ``silu(gate_n) * up_n``; a program dots the gate and the up row of each of its outputs
    (interleaved in its tile), so SwiGLU is the matmul's epilogue and ``down_proj`` a plain GEMV.
    """
    block = tl.program_id(0)
    row_index = tl.program_id(1).to(tl.int64)
    x_row_ptr = x_ptr + row_index * x_stride_row
    residual_row_ptr = residual_ptr + row_index * residual_stride_row
    summed_row_ptr = summed_ptr + row_index * summed_stride_row
    # One program per row writes the sum x + residual (the next residual stream).
    is_summed_writer = (block == 0).to(tl.int32)
    if GATED_OUT:  # tile row 2j is output j's gate row, 2j + 1 its up row
        tile_rows = tl.arange(0, 2 * BLOCK_N)
        outputs = block * BLOCK_N + tile_rows // 2
        weight_row_index = outputs + (tile_rows % 2) * num_outputs
    else:
        outputs = block * BLOCK_N + tl.arange(0, BLOCK_N)
        weight_row_index = outputs
    output_mask = outputs < num_outputs
    weight_rows = weight_ptr + weight_row_index.to(tl.int64)[:, None] * weight_stride_row
    first_cols = tl.arange(0, BLOCK_K)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    weight = tl.load(weight_rows + first_cols[None, :], mask=output_mask[:, None] & (first_cols < reduction)[None, :],
                     other=0.0)
    if PRELOAD:
        second_cols = first_cols + BLOCK_K
        next_weight = tl.load(weight_rows + second_cols[None, :],
                              mask=output_mask[:, None] & (second_cols < reduction)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the row (and the residual) are the previous kernel's outputs
    acc = tl.zeros([2 * BLOCK_N if GATED_OUT else BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, reduction, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_mask = cols < reduction
        next_cols = cols + BLOCK_K
        next_mask = output_mask[:, None] & (next_cols < reduction)[None, :]
        if PRELOAD:  # the tile after the next
            after_cols = next_cols + BLOCK_K
            after_weight = tl.load(weight_rows + after_cols[None, :],
                                   mask=output_mask[:, None] & (after_cols < reduction)[None, :], other=0.0)
        elif PREFETCH:
            next_weight = tl.load(weight_rows + next_cols[None, :], mask=next_mask, other=0.0)
        row = _row_chunk(x_row_ptr, residual_row_ptr, summed_row_ptr, cols, col_mask, reduction, is_summed_writer,
                         PROLOGUE=PROLOGUE, HAS_RESIDUAL=HAS_RESIDUAL)
        if PROLOGUE == 1:
            squares += row * row
            row = row * tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc += weight.to(tl.float32) * row[None, :]
        if PRELOAD:
            weight = next_weight
            next_weight = after_weight
        elif PREFETCH:
            weight = next_weight
        else:
            weight = tl.load(weight_rows + next_cols[None, :], mask=next_mask, other=0.0)
    out = tl.sum(acc, 1)
    if PROLOGUE == 1:
        out = out * tl.rsqrt(tl.sum(squares, 0) / reduction + eps)
    if GATED_OUT:  # rounded to the storage dtype where the unfused path stores gate_up, as silu_and_mul does
        storage = out_ptr.dtype.element_ty
        gate, up = tl.split(tl.reshape(out, [BLOCK_N, 2]))
        gate, up = gate.to(storage).to(tl.float32), up.to(storage).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        outputs = block * BLOCK_N + tl.arange(0, BLOCK_N)
        output_mask = outputs < num_outputs
    tl.store(out_ptr + row_index * out_stride_row + outputs, out.to(out_ptr.dtype.element_ty), mask=output_mask)


def _check_weight(weight: torch.Tensor, reduction: int, name: str) -> torch.Tensor:
    if weight.dim() != 2 or weight.shape[1] != reduction:
        raise ValueError(f"{name} must be [N, {reduction}], got {tuple(weight.shape)}")
    return weight if weight.stride(-1) == 1 else weight.contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, K], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _rms_norm_inputs(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checked ``(x, residual, summed, weight)`` of an RMSNorm-prologue GEMV: without a residual,
    ``residual`` and ``summed`` are ``x`` itself (HAS_RESIDUAL is False when residual is x)."""
    x = _rows(x)
    reduction = x.shape[1]
    if norm_weight.shape != (reduction,):
        raise ValueError(f"norm_weight must be ({reduction},), got {tuple(norm_weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    weight = _check_weight(weight, reduction, "weight")
    if residual is None:
        return x, x, x, weight
    return x, _rows(residual), torch.empty_like(x), weight


# Programmatic dependent launch (Hopper and newer): each GEMV lets the kernel after it start early and
# loads its first weight tile before waiting for the one before it, so the launch and the ramp-up of
# one matmul overlap the tail of the previous one. Off: plain launches (benchmarks A/B it).
USE_PDL = True


@functools.cache
def _device_has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def uses_pdl(tensor: torch.Tensor) -> bool:
    """Whether a GEMV on ``tensor``'s device launches with programmatic dependent launch."""
    return USE_PDL and tensor.is_cuda and _device_has_pdl(tensor.device.index or 0)


def _launch(out, summed, x, residual, norm_weight, weight, reduction, eps, prologue, launch, gated_out=False):
    num_rows, num_outputs = out.shape
    if num_rows == 0 or num_outputs == 0:
        return
    launch = launch or default_launch(num_outputs, reduction, prologue, gated_out)
    grid = (triton.cdiv(num_outputs, launch.block_n), num_rows)
    use_pdl = uses_pdl(out)
    extra = {"launch_pdl": True} if use_pdl else {}
    _gemv_kernel[grid](
        out, summed, x, residual, norm_weight, weight, num_outputs, reduction, eps,
        x.stride(0), residual.stride(0), summed.stride(0), out.stride(0), weight.stride(0),
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not x, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        USE_PDL=use_pdl, PREFETCH=launch.prefetch, GATED_OUT=gated_out, num_warps=launch.num_warps,
        **({"PRELOAD": True} if launch.preload else {}), **extra,
    )


def linear(x: torch.Tensor, weight: torch.Tensor, launch: GemvLaunch | None = None) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` ``[rows, K]``; see ``reference.linear``."""
    x = _rows(x)
    weight = _check_weight(weight, x.shape[1], "weight")
    out = x.new_empty(x.shape[0], weight.shape[0])
    _launch(out, x, x, x, x, weight, x.shape[1], 0.0, PLAIN, launch)
    return out


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, launch: GemvLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(x + residual) @ weight.T, x + residual)`` in one launch; see ``reference.rms_norm_linear``.

    >>> out, summed = rms_norm_linear(hidden[:1], residual[:1], norm.weight, norm.eps, qkv_proj.weight)
    """
    x, residual, summed, weight = _rms_norm_inputs(x, residual, norm_weight, weight)
    reduction = x.shape[1]
    out = x.new_empty(x.shape[0], weight.shape[0])
    _launch(out, summed, x, residual, norm_weight.contiguous(), weight, reduction, eps, RMS_NORM, launch)
    return out, summed


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, launch: GemvLaunch | None = None) -> torch.Tensor:
    """``(silu(x[:, :I]) * x[:, I:]) @ weight.T`` in one launch, ``I = weight.shape[1]``; see
    ``reference.silu_and_mul_linear``."""
    x = _rows(x)
    reduction = weight.shape[1] if weight.dim() == 2 else -1
    if x.shape[1] != 2 * reduction:
        raise ValueError(f"x must be [rows, 2 * {reduction}] (gate and up halves) for weight "
                         f"{tuple(weight.shape)}, got {tuple(x.shape)}")
    weight = _check_weight(weight, reduction, "weight")
    out = x.new_empty(x.shape[0], weight.shape[0])
    _launch(out, x, x, x, x, weight, reduction, 0.0, SILU_AND_MUL, launch)
    return out


def rms_norm_linear_silu_and_mul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                                 eps: float, weight: torch.Tensor,
                                 launch: GemvLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu_and_mul(RMSNorm(x + residual) @ weight.T), x + residual)`` in one launch, ``weight``
    ``[2 * I, K]`` (gate rows, then up rows); see ``reference.rms_norm_linear_silu_and_mul``."""
    x, residual, summed, weight = _rms_norm_inputs(x, residual, norm_weight, weight)
    reduction = x.shape[1]
    if weight.shape[0] % 2:
        raise ValueError(f"weight must stack gate and up rows ([2 * I, {reduction}]), got {tuple(weight.shape)}")
    out = x.new_empty(x.shape[0], weight.shape[0] // 2)
    _launch(out, summed, x, residual, norm_weight.contiguous(), weight, reduction, eps, RMS_NORM, launch, gated_out=True)
    return out, summed
