"""Triton: the MLP activations (SwiGLU, GeGLU, GELU); see ``reference.py``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import next_power_of_2, tanh, warps_for
from . import reference


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, intermediate_size, x_stride_row, out_stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride_row + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_stride_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a merged gate/up projection: ``silu(x[..., :I]) * x[..., I:]``."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul needs an even last dimension (gate and up halves), got {x.shape[-1]}")
    intermediate_size = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], intermediate_size, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or intermediate_size == 0:
        return out
    out_rows = out.view(-1, intermediate_size)
    block = min(1024, next_power_of_2(intermediate_size))
    grid = (rows.shape[0], triton.cdiv(intermediate_size, block))
    _silu_and_mul_kernel[grid](out_rows, rows, intermediate_size, rows.stride(0), out_rows.stride(0),
                               BLOCK=block, num_warps=warps_for(4 * block))
    return out




@triton.jit
def _gelu_kernel(out_ptr, x_ptr, num_cols, x_stride_row, out_stride_row,
                 IS_GATED: tl.constexpr, IS_TANH: tl.constexpr, BLOCK: tl.constexpr):
    """GELU of ``num_cols`` columns per row; gated (GeGLU) rows multiply by the up half after them."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    # The constants are literals: the compiler refuses plain module globals, and the interpreter
    # cannot multiply by constexpr ones.
    if IS_TANH:
        out = 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))  # sqrt(2 / pi)
    else:
        out = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))  # 1 / sqrt(2)
    if IS_GATED:
        out = out * tl.load(x_ptr + row * x_stride_row + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU activation of a merged gate/up projection: ``gelu(x[..., :I]) * x[..., I:]``."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"gelu_and_mul needs an even last dimension (gate and up halves), got {x.shape[-1]}")
    return _gelu(x, approximate, is_gated=True)


def gelu(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU (``approximate`` "tanh" or "none") of a non-gated MLP's up projection."""
    return _gelu(x, approximate, is_gated=False)


def _gelu(x: torch.Tensor, approximate: str, is_gated: bool) -> torch.Tensor:
    reference.check_gelu_approximate(approximate)
    num_cols = x.shape[-1] // 2 if is_gated else x.shape[-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], num_cols, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or num_cols == 0:
        return out
    out_rows = out.view(-1, num_cols)
    block = min(1024, next_power_of_2(num_cols))
    grid = (rows.shape[0], triton.cdiv(num_cols, block))
    _gelu_kernel[grid](out_rows, rows, num_cols, rows.stride(0), out_rows.stride(0),
                       IS_GATED=is_gated, IS_TANH=approximate == "tanh", BLOCK=block, num_warps=warps_for(4 * block))
    return out
