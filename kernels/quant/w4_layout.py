"""The GPU layout of ``W4G128`` weights (AWQ/GPTQ 4-bit, groups of 128): the same values, repacked
so a GEMV reads them in wide, coalesced loads, and its plain-torch reference.

``W4G128`` rows (``gguf_reference``) interleave each group's 4-byte header with its 64 code bytes, so
a group starts every 68 bytes and no load wider than 4 bytes is aligned. :class:`W4Weight` splits
them into two arrays (the same 68 bytes a group, every value kept):

- ``codes`` int32 ``[N, K / 8]``: row ``n``, word ``16 g + c`` (``c`` = 0..15) holds the codes of
  inputs ``128 g + 16 i + c`` in nibble ``i`` (bits ``4 i .. 4 i + 3``), so nibble ``i`` of a
  group's 16 words meets 16 consecutive inputs;
- ``headers`` int32 ``[K / 128, N]``: the group header word as ``W4G128`` stores it (float16 scale
  in bits 0..15, zero point in bits 16..23), one group's headers of all rows side by side.

The value of weight ``(n, k)`` is ``scale * (code - zero)``. :func:`from_rows` and :func:`to_rows`
convert exactly both ways; :func:`reference_linear` is what every kernel computes.

>>> weight = from_rows(gguf_reference.pack_w4g128(codes, scales, zeros))
>>> torch.equal(dequantize(weight), gguf_reference.dequantize(to_rows(weight), "W4G128"))
True
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hearth_llm.kernels import register_linear_routine

GROUP = 128
NIBBLE_SHIFTS = tuple(range(0, 32, 4))


@dataclass(frozen=True, slots=True, eq=False)
class W4Weight:
    """A ``[N, K]`` weight in the layout of the module docstring: ``codes`` int32 ``[N, K / 8]``,
    ``headers`` int32 ``[K / 128, N]``."""

    codes: torch.Tensor
    headers: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 8


def from_rows(data: torch.Tensor) -> W4Weight:
    """:class:`W4Weight` from uint8 ``W4G128`` rows ``[N, K / 128 * 68]`` (same device)."""
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % 68:
        raise ValueError(f"data must be uint8 W4G128 rows [N, K / 128 * 68], got {data.dtype} {tuple(data.shape)}")
    num_rows, num_groups = data.shape[0], data.shape[1] // 68
    groups = data.reshape(num_rows, num_groups, 68)
    headers = groups[..., :4].contiguous().view(torch.int32).reshape(num_rows, num_groups).t().contiguous()
    code_bytes = groups[..., 4:]                                                       # [N, G, 64]
    columns = torch.cat((code_bytes & 0xF, code_bytes >> 4), dim=-1).to(torch.int32)   # [N, G, 128]
    nibbles = columns.reshape(num_rows, num_groups, 8, 16).transpose(2, 3)            # [N, G, c, i]
    shifts = torch.tensor(NIBBLE_SHIFTS, dtype=torch.int32, device=data.device)
    words = (nibbles << shifts).sum(-1, dtype=torch.int64)                             # < 2^32: exact
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return W4Weight(words.reshape(num_rows, num_groups * 16), headers)


def code_columns(weight: W4Weight) -> torch.Tensor:
    """The codes 0..15 as ``[N, K]`` uint8, in input order."""
    num_rows, num_words = weight.codes.shape
    shifts = torch.tensor(NIBBLE_SHIFTS, dtype=torch.int32, device=weight.codes.device)
    nibbles = (weight.codes.reshape(num_rows, num_words // 16, 16, 1) >> shifts) & 0xF    # [N, G, c, i]
    return nibbles.transpose(2, 3).reshape(num_rows, num_words * 8).to(torch.uint8)


def scales_and_zeros(weight: W4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 scales and int32 zero points, both ``[N, K / 128]``."""
    headers = weight.headers.t().contiguous()
    scales = headers.view(torch.float16).reshape(*headers.shape, 2)[..., 0]  # little-endian: bits 0..15
    return scales, (headers >> 16) & 0xFF


def to_rows(weight: W4Weight) -> torch.Tensor:
    """The uint8 ``W4G128`` rows :func:`from_rows` was given (exact inverse)."""
    num_rows = weight.out_features
    columns = code_columns(weight).reshape(num_rows, -1, 2, 64)
    code_bytes = columns[:, :, 0] | (columns[:, :, 1] << 4)                            # [N, G, 64]
    headers = weight.headers.t().contiguous().view(torch.uint8).reshape(num_rows, -1, 4)
    return torch.cat((headers, code_bytes), dim=-1).reshape(num_rows, -1)


def dequantize(weight: W4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[N, K]`` weight ``scale * (code - zero)``, computed in float32, returned in ``dtype``."""
    scales, zeros = scales_and_zeros(weight)
    codes = code_columns(weight).reshape(weight.out_features, -1, GROUP).float()
    values = (codes - zeros[..., None].float()) * scales.float()[..., None]
    return values.reshape(weight.out_features, -1).to(dtype)


def reference_linear(x: torch.Tensor, weight: W4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` dequantized whole (float32, then ``x``'s dtype)."""
    return F.linear(x, dequantize(weight, x.dtype), bias)


def _cuda_linear(x, weight: W4Weight, bias):
    from .triton_w4 import w4_linear  # triton is imported only when a CUDA tensor needs it

    return w4_linear(x, weight, bias)


register_linear_routine(W4Weight, None, reference_linear)
register_linear_routine(W4Weight, "cuda", _cuda_linear)
