"""Quantized linear methods, and which one each layer gets.

The methods plug into the linear seam (``engine/models/linear_method.py``) and are chosen before
loading, from the checkpoint (the GGUF tensor types in ``checkpoint.weight_formats``, an HF
``quantization_config``) and from ``LLM(quantization=...)``:

- ``gguf_block_method.py``: GGUF Q4_0 .. Q6_K kept as the file's blocks (Triton on CUDA, a tiled
  dequantize-and-multiply on the CPU).
- ``fp8_method.py``: ``quantization="fp8"``, a 16/32-bit checkpoint quantized to e4m3 at load
  (per-channel weight scales, dynamic per-token activation scales, ``torch._scaled_mm``).

:func:`check_quantization` runs before any weight is read and refuses, by name, what is not
implemented; :func:`gguf_layer_method` picks a GGUF layer's method, :func:`dense_layer_method`
the method of a layer the checkpoint stores unquantized.

>>> plan = check_quantization("gguf", config, weight_formats, torch.device("cpu"))
>>> gguf_layer_method({"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}, layer, plan, torch.device("cpu"), torch.float32)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth_llm.kernels.quant.fp8 import has_fp8_gemm

from ...config import QUANTIZATION_METHODS
from .fp8_method import FP8, Fp8LinearMethod
from .gguf_block_method import GGUFBlockLinearMethod

__all__ = ["Fp8LinearMethod", "GGUFBlockLinearMethod", "QuantizationPlan", "QUANTIZATION_METHODS",
           "check_quantization", "dense_layer_method", "gguf_layer_method"]
# HF ``quantization_config.quant_method`` values this engine runs.
HF_QUANT_METHODS: tuple[str, ...] = ()


# Whether GGUF layers run from their blocks on CUDA without ``quantization="gguf"``. Off until the
# Triton kernel has passed tests/test_gpu_quant.py on a GPU (it is checked under TRITON_INTERPRET
# on the CPU only); until then CUDA, like the CPU, dequantizes non-Q4 GGUF weights at load.
GGUF_BLOCKS_ON_CUDA_BY_DEFAULT = False


@dataclass(frozen=True, slots=True)
class QuantizationPlan:
    """What :func:`check_quantization` decided: ``requested`` is the user's ``quantization`` (or None)."""

    requested: str | None = None

    def keeps_gguf_blocks(self, device: torch.device) -> bool:
        """Whether GGUF layers stay in their blocks on ``device`` (~1x the file's memory; on the CPU
        decode is several times slower than a dense copy, see ``kernels/quant/gguf_cpu.py``)."""
        if self.requested == "gguf":
            return True
        return torch.device(device).type == "cuda" and GGUF_BLOCKS_ON_CUDA_BY_DEFAULT


def check_quantization(requested: str | None, config, weight_formats: dict[str, str],
                       device: torch.device) -> QuantizationPlan:
    """The quantization to load with, checked against the checkpoint before any weight is read:
    ValueError naming the field and what is supported otherwise."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported; supported: {list(QUANTIZATION_METHODS)} or "
                         "None (what the checkpoint holds)")
    _check_hf_quantization_config(config)
    if requested == "gguf" and not weight_formats:
        raise ValueError("quantization='gguf' needs a GGUF file with block-quantized tensors; this checkpoint has none")
    if requested == "fp8":
        if weight_formats:
            raise ValueError("quantization='fp8' quantizes a 16/32-bit checkpoint at load; this GGUF file is "
                             "already quantized (use quantization=None or 'gguf')")
        if not has_fp8_gemm(device):
            raise ValueError(f"quantization='fp8' needs FP8 GEMMs: a CUDA GPU of compute capability 8.9 or newer "
                             f"(Ada, Hopper); {device} has {torch.cuda.get_device_capability(device)}")
    return QuantizationPlan(requested)


def _check_hf_quantization_config(config) -> None:
    quant_config = getattr(config, "quantization_config", None)
    if quant_config is None:
        return
    if not isinstance(quant_config, dict):
        quant_config = quant_config.to_dict() if hasattr(quant_config, "to_dict") else vars(quant_config)
    quant_method = quant_config.get("quant_method")
    if quant_method not in HF_QUANT_METHODS:
        raise ValueError(f"config.json: quantization_config.quant_method={quant_method!r} is not supported; "
                         f"supported: {list(HF_QUANT_METHODS) or 'none yet'} (GGUF files are, as .gguf)")


def gguf_layer_method(shard_types: dict, layer, plan: QuantizationPlan, device: torch.device,
                      dtype: torch.dtype):
    """A GGUF layer's block method where the plan keeps blocks on ``device``, else None (the
    caller keeps its choice: the int4 CPU method for Q4_0/Q4_1, or dense, dequantized at load)."""
    if not set(shard_types.values()) <= set(GGUFBlockLinearMethod.quant_types) or not plan.keeps_gguf_blocks(device):
        return None
    return GGUFBlockLinearMethod(shard_types)


def dense_layer_method(layer, plan: QuantizationPlan):
    """The method of a layer the checkpoint stores unquantized: FP8 under ``quantization="fp8"``
    (where the layer's sizes fit the FP8 GEMM), else None (dense)."""
    if plan.requested == "fp8" and Fp8LinearMethod.supports(layer):
        return FP8
    return None
