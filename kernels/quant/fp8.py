"""FP8 (e4m3) W8A8 linear: per-output-channel weight scales, dynamic per-token activation scales.

``w ≈ weight_fp8 * weight_scale[n]`` (row ``n``), ``x ≈ x_fp8 * x_scale[m]`` (token ``m``), so
``x @ w.T ≈ (x_fp8 @ weight_fp8.T) * x_scale[m] * weight_scale[n]``: ``torch._scaled_mm`` with
row-wise scales does exactly that on Hopper (and on the CPU, slowly). :func:`fp8_linear_reference`
is the same math in float32 matmuls, the reference the kernel is tested against.

>>> weight_fp8, weight_scale = quantize_rows(torch.randn(32, 64))
>>> fp8_linear(torch.randn(4, 64, dtype=torch.bfloat16), weight_fp8, weight_scale).shape
torch.Size([4, 32])
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# A row of zeros gets this scale instead of 0 (its codes are 0 either way).
MIN_SCALE = 1e-12


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 [R, C], float32 scales [R])`` with ``t[r] ≈ fp8[r] * scale[r]``, the largest
    magnitude of each row mapped to 448 (round to nearest even on the cast)."""
    scale = (t.abs().amax(dim=-1).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    quantized = (t.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def fp8_linear_reference(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 product in float32 (see the module docstring); the result in ``x``'s dtype."""
    x_fp8, x_scale = quantize_rows(x)
    out = (x_fp8.float() @ weight_fp8.float().t()) * x_scale[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` through ``torch._scaled_mm`` (row-wise scales, bf16 out, then ``x``'s dtype).

    ``weight_fp8`` is row-major ``[N, K]``; its transpose is the column-major operand the FP8 GEMM
    wants, with no copy. Both ``K`` and ``N`` must be multiples of 16.
    """
    x_fp8, x_scale = quantize_rows(x)
    out = torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a=x_scale[:, None], scale_b=weight_scale.float()[None, :],
                           out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias
    return out.to(x.dtype)


def has_fp8_gemm(device: torch.device) -> bool:
    """Whether ``device`` runs FP8 GEMMs: CUDA compute capability 8.9 (Ada) or newer; the CPU runs
    ``_scaled_mm`` too (emulated, slow, for tests)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu" and hasattr(torch, "_scaled_mm")
