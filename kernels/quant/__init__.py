"""Quantized-weight kernels, each beside its plain-torch reference, behind ``kernels.linear``.

- GGUF block formats (llama.cpp's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), kept as the
  file's bytes: ``gguf_reference.py`` (exact dequantizers, bit-equal to gguf-py), ``gguf_triton.py``
  (CUDA: dequantize in registers inside a GEMM/GEMV), ``gguf_cpu.py`` (numba's GEMV for decode
  steps, ``gguf_numba.py``; else dequantize a tile at a time). AWQ/GPTQ 4-bit weights run through
  the same kernels, repacked exactly into the ``W4G128`` block format.
- FP8 W8A8 (e4m3, per-channel weight scales, dynamic per-token activation scales): ``fp8.py``
  (``torch._scaled_mm``, and its float32 reference); ``triton_fp8.py`` on CUDA (a one-launch
  activation quantizer, a GEMV for decode-sized steps, ``_scaled_mm`` above that).

Importing this package registers the routines, so ``kernels.linear(x, GGUFBlockWeight(...))`` picks
Triton for CUDA inputs, the tiled CPU path for CPU ones.

>>> from hearth_llm.kernels import linear
>>> from hearth_llm.kernels.quant import GGUFBlockWeight, gguf_reference
>>> weight = GGUFBlockWeight("Q8_0", gguf_reference.quantize(torch.randn(8, 64), "Q8_0"))
>>> linear(torch.randn(2, 64), weight).shape
torch.Size([2, 8])
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth_llm.kernels import register_linear_routine

from . import fp8, gguf_cpu, gguf_reference
from .gguf_reference import BLOCK_FORMATS, GGUF_TYPES, block_format

__all__ = ["Fp8Weight", "GGUFBlockWeight", "BLOCK_FORMATS", "GGUF_TYPES", "block_format"]


@dataclass(frozen=True, slots=True, eq=False)
class GGUFBlockWeight:
    """A ``[N, K]`` weight as llama.cpp block rows: uint8 ``data`` ``[N, K / block_size * type_size]``."""

    quant_type: str
    data: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return block_format(self.quant_type).num_columns(self.data.shape[1])


@dataclass(frozen=True, slots=True, eq=False)
class Fp8Weight:
    """A ``[N, K]`` weight as e4m3 values ``weight`` and float32 per-row scales ``scale`` ``[N]``."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


def _triton_linear(x, weight: GGUFBlockWeight, bias):
    from . import gguf_triton  # triton is imported only when a CUDA tensor needs it

    return gguf_triton.gguf_linear(x, weight.data, weight.quant_type, bias)


register_linear_routine(GGUFBlockWeight, None,
                        lambda x, weight, bias: gguf_reference.gguf_linear(x, weight.data, weight.quant_type, bias))
register_linear_routine(GGUFBlockWeight, "cpu",
                        lambda x, weight, bias: gguf_cpu.gguf_linear(x, weight.data, weight.quant_type, bias))
register_linear_routine(GGUFBlockWeight, "cuda", _triton_linear)
register_linear_routine(Fp8Weight, None, lambda x, weight, bias: fp8.fp8_linear(x, weight.weight, weight.scale, bias))


def _triton_fp8_linear(x, weight: Fp8Weight, bias):
    from . import triton_fp8  # triton is imported only when a CUDA tensor needs it

    return triton_fp8.fp8_linear(x, weight.weight, weight.scale, bias)


register_linear_routine(Fp8Weight, "cuda", _triton_fp8_linear)
