"""Triton: RMSNorm and LayerNorm of ``x + residual``, each one kernel per row; see ``reference.py``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import next_power_of_2, warps_for


@triton.jit
def _rms_norm_kernel(
    normed_ptr, summed_ptr, x_ptr, residual_ptr, weight_ptr,
    hidden_size, eps,
    x_stride_row, residual_stride_row, normed_stride_row, summed_stride_row,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """``USE_PDL``: launched early behind the kernel before it (the bs1 decode GEMVs), it loads the
    norm weight first and waits for that kernel only before reading the row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride_row + cols, mask=mask, other=0.0)
        # Round the sum to its storage dtype before norming it, as the reference norms the stored sum.
        summed = (x + residual.to(tl.float32)).to(summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * summed_stride_row + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden_size + eps)
    # The reference rounds the normed value to the input dtype before scaling by the weight.
    normed = (x * inverse_rms).to(summed_ptr.dtype.element_ty).to(tl.float32)
    tl.store(normed_ptr + row * normed_stride_row + cols, (normed * weight).to(normed_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual``; returns ``(normed, x + residual)``, both written by one kernel."""
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight must have shape ({hidden_size},) to norm rows of x {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    rows = x.reshape(-1, hidden_size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    summed_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    normed = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, summed_dtype), device=x.device)
    if residual is None:
        residual_rows, summed = rows, x
        # The kernel reads the summed dtype from this pointer; with no residual it is x's own.
        summed_rows = rows
    else:
        residual_rows = residual.reshape(-1, hidden_size)
        if residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
        summed = torch.empty(x.shape, dtype=summed_dtype, device=x.device)
        summed_rows = summed.view(-1, hidden_size)
    if rows.shape[0] == 0:
        return normed, summed
    block = next_power_of_2(hidden_size)
    normed_rows = normed.view(-1, hidden_size)
    _rms_norm_kernel[(rows.shape[0],)](
        normed_rows, summed_rows, rows, residual_rows, weight.contiguous(), hidden_size, eps,
        rows.stride(0), residual_rows.stride(0), normed_rows.stride(0), summed_rows.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps_for(block), **_pdl_launch(rows),
    )
    return normed, summed


def _pdl_launch(rows: torch.Tensor) -> dict:
    """Programmatic dependent launch for one-row norms where the bs1 GEMVs use it (``kernels/gemv``)."""
    from ..gemv.triton_gemv import uses_pdl

    return {"USE_PDL": True, "launch_pdl": True} if rows.shape[0] == 1 and uses_pdl(rows) else {}


@triton.jit
def _layer_norm_kernel(
    normed_ptr, summed_ptr, x_ptr, residual_ptr, weight_ptr, bias_ptr,
    hidden_size, eps,
    x_stride_row, residual_stride_row, normed_stride_row, summed_stride_row,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride_row + cols, mask=mask, other=0.0)
        # Round the sum to its storage dtype before norming it, as the reference norms the stored sum.
        summed = (x + residual.to(tl.float32)).to(summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * summed_stride_row + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean = tl.sum(x, 0) / hidden_size
    centered = tl.where(mask, x - mean, 0.0)
    inverse_std = tl.rsqrt(tl.sum(centered * centered, 0) / hidden_size + eps)
    normed = centered * inverse_std * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        normed = normed + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * normed_stride_row + cols, normed.to(normed_ptr.dtype.element_ty), mask=mask)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of ``x + residual``; returns ``(normed, x + residual)``, both written by one kernel."""
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,) or (bias is not None and bias.shape != (hidden_size,)):
        raise ValueError(f"weight and bias must have shape ({hidden_size},) to norm rows of x {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    rows = x.reshape(-1, hidden_size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if residual is None:
        residual_rows, summed, summed_rows = rows, x, rows
    else:
        residual_rows = residual.reshape(-1, hidden_size)
        if residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
        summed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        summed_rows = summed.view(-1, hidden_size)
    normed = torch.empty(x.shape, dtype=summed.dtype, device=x.device)
    if rows.shape[0] == 0:
        return normed, summed
    block = next_power_of_2(hidden_size)
    normed_rows = normed.view(-1, hidden_size)
    weight = weight.contiguous()
    _layer_norm_kernel[(rows.shape[0],)](
        normed_rows, summed_rows, rows, residual_rows, weight, weight if bias is None else bias.contiguous(),
        hidden_size, eps, rows.stride(0), residual_rows.stride(0), normed_rows.stride(0), summed_rows.stride(0),
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps_for(block),
    )
    return normed, summed
