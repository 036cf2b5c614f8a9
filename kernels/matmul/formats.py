"""Weight formats: what a linear layer's weight is stored as, so ``kernels.linear`` can pick the
routine that multiplies by it (by the format and the input's device).

A format is a small frozen record around the tensors a routine needs. A quantization method adds a
format here and registers its routines with ``kernels.register_linear_routine``; model code only
ever calls ``kernels.linear(x, weight, bias)``.

>>> weight = DenseWeight(torch.randn(8, 16))
>>> weight.out_features, weight.in_features
(8, 16)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu


@dataclass(frozen=True, slots=True, eq=False)
class DenseWeight:
    """A plain ``[N, K]`` weight in the compute dtype (float32, bf16 or fp16), on any device."""

    weight: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


@dataclass(frozen=True, slots=True, eq=False)
class OnednnBf16Weight:
    """A bf16 weight in oneDNN's blocked layout, for CPU matmuls (see :func:`cpu.pack_dense_weight`)."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> OnednnBf16Weight | None:
        """The packed copy of a ``[N, K]`` bf16 CPU weight; None where oneDNN has no bf16 here."""
        packed = cpu.pack_dense_weight(weight)
        return None if packed is None else cls(packed, weight.shape[0], weight.shape[1])


@dataclass(frozen=True, slots=True, eq=False)
class Fp16Weight:
    """fbgemm's packed fp16 copy of a weight; its products come out in float32."""

    packed: object
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Fp16Weight | None:
        """The packed copy of a ``[N, K]`` CPU weight; None without fbgemm."""
        packed = cpu.pack_fp16_weight(weight)
        return None if packed is None else cls(packed, weight.shape[0], weight.shape[1])


@dataclass(frozen=True, slots=True, eq=False)
class Int4Weight:
    """A weight on a 4-bit grid per group of ``group_size`` inputs, packed for the CPU int4 kernel."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int = cpu.INT4_GROUP_SIZE

    @classmethod
    def if_lossless(cls, weight: torch.Tensor, group_size: int = cpu.INT4_GROUP_SIZE) -> Int4Weight | None:
        """The int4 copy of a bf16 weight when 4 bits hold it exactly, else None
        (see :func:`cpu.int4_weight_if_lossless`)."""
        int4 = cpu.int4_weight_if_lossless(weight, group_size)
        return None if int4 is None else cls(*int4, group_size)
