"""Quantized linear methods, and which one each layer gets.

The methods plug into the linear seam (``engine/models/linear_method.py``) and are chosen before
loading, from the checkpoint (the GGUF tensor types in ``checkpoint.weight_formats``, an HF
``quantization_config``) and from ``LLM(quantization=...)``:

- ``gguf_block_method.py``: GGUF Q4_0 .. Q6_K kept as the file's blocks (Triton on CUDA; on the
  CPU numba's fused GEMV for decode steps, a tiled dequantize-and-multiply for larger batches).
- ``fp8_method.py``: ``quantization="fp8"``, a 16/32-bit checkpoint quantized to e4m3 at load
  (per-channel weight scales, dynamic per-token activation scales, ``torch._scaled_mm``), and FP8
  checkpoints loaded as stored (``compressed_tensors.py``: llm-compressor's FP8 W8A8 dynamic).
- ``awq_gptq.py``: AWQ (GEMM) and GPTQ (desc_act=False) 4-bit checkpoints, repacked exactly into
  the ``W4G128`` block format as they stream in, then run by the block method.

:func:`check_quantization` runs before any weight is read and refuses, by name, what is not
implemented; :func:`quantized_layer_method` picks the method of a layer the checkpoint stores
quantized (``plan.weight_formats``), :func:`dense_layer_method` of one it stores unquantized.

>>> plan = check_quantization("gguf", config, checkpoint.weight_formats, checkpoint.weight_shapes(), device)
>>> quantized_layer_method({"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}, layer, plan, device, torch.float32)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hearth_llm.kernels.quant import gguf_cpu_native
from hearth_llm.kernels.quant.fp8 import has_fp8_gemm

from ...config import QUANTIZATION_METHODS
from .awq_gptq import W4G128, Int4CheckpointScheme, W4G128LinearMethod
from .compressed_tensors import FP8_FORMAT, Fp8CheckpointScheme
from .fp8_method import FP8, FP8_CHECKPOINT, Fp8CheckpointLinearMethod, Fp8LinearMethod
from .gguf_block_method import GGUFBlockLinearMethod

__all__ = ["Fp8CheckpointLinearMethod", "Fp8LinearMethod", "GGUFBlockLinearMethod", "QuantizationPlan",
           "QUANTIZATION_METHODS", "check_quantization", "dense_layer_method", "quantized_layer_method"]
# HF ``quantization_config.quant_method`` values this engine runs.
HF_QUANT_METHODS = ("compressed-tensors", "awq", "gptq")


# Whether GGUF layers run from their blocks on CUDA without ``quantization="gguf"``. Off until the
# Triton kernel has passed tests/test_gpu_quant.py on a GPU (it is checked under TRITON_INTERPRET
# on the CPU only); until then CUDA dequantizes GGUF weights at load, as before.
GGUF_BLOCKS_ON_CUDA_BY_DEFAULT = False


@dataclass(frozen=True, slots=True)
class QuantizationPlan:
    """What :func:`check_quantization` decided: ``requested`` is the user's ``quantization`` (or None),
    ``weight_formats`` the checkpoint's quantized weights (name -> GGUF type, ``"fp8_e4m3"`` or
    ``"W4G128"``), ``scheme`` an HF-quantized checkpoint's scheme (FP8, AWQ, GPTQ)."""

    requested: str | None = None
    weight_formats: dict = field(default_factory=dict)
    scheme: Fp8CheckpointScheme | Int4CheckpointScheme | None = None

    def checkpoint_shapes(self, shapes):
        """The headers' shapes as the model receives the tensors."""
        return shapes if self.scheme is None or shapes is None else self.scheme.checkpoint_shapes(shapes)

    def weights(self, stream, shapes):
        """The checkpoint's stream as the model receives it (FP8 scales per row, AWQ/GPTQ repacked)."""
        return stream if self.scheme is None else self.scheme.weights(stream, shapes)

    def keeps_gguf_blocks(self, device: torch.device, dtype: torch.dtype | None = None, formats=()) -> bool:
        """Whether a GGUF layer of tensor types ``formats`` stays in its blocks on ``device`` (~1x the
        file's memory): always under ``quantization="gguf"``; by default on the CPU where the C kernels
        are built (``kernels/quant/gguf_cpu_native.py``): in bf16 except layers all Q4_0/Q4_1, which the
        int4 CPU method runs; in float32 (CPUs without AVX-512 BF16) layers whose every type has a
        vectorized float32 GEMV (AVX2: Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K, so Q4_K_M, Q5_K_M and Q6_K files),
        except layers all Q4_0/Q4_1/Q8_0, which the panel kernels run. Other float32 layers are
        dequantized at load."""
        if self.requested == "gguf":
            return True
        if torch.device(device).type == "cpu":
            if not gguf_cpu_native.available():
                return False
            if dtype == torch.float32:
                return (not set(formats) <= {"Q4_0", "Q4_1", "Q8_0"}
                        and all(gguf_cpu_native.has_vector_float32(quant_type) for quant_type in formats))
            return dtype == torch.bfloat16 and not set(formats) <= {"Q4_0", "Q4_1"}
        return torch.device(device).type == "cuda" and GGUF_BLOCKS_ON_CUDA_BY_DEFAULT


def check_quantization(requested: str | None, config, weight_formats: dict[str, str], shapes,
                       device: torch.device) -> QuantizationPlan:
    """The quantization to load with, checked against the checkpoint (its config, GGUF tensor
    types and header shapes) before any weight is read: ValueError naming the field and what is
    supported otherwise."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported; supported: {list(QUANTIZATION_METHODS)} or "
                         "None (what the checkpoint holds)")
    scheme = _hf_quantization_scheme(config)
    if scheme is not None:
        if requested is not None:
            raise ValueError(f"quantization={requested!r}: this checkpoint is already quantized (config.json "
                             "quantization_config); leave quantization None")
        if isinstance(scheme, Fp8CheckpointScheme):
            _check_fp8_device(device, "an FP8 checkpoint")
        return QuantizationPlan(None, scheme.weight_formats(shapes), scheme)
    if requested == "gguf" and not weight_formats:
        raise ValueError("quantization='gguf' needs a GGUF file with block-quantized tensors; this checkpoint has none")
    if requested == "fp8":
        if weight_formats:
            raise ValueError("quantization='fp8' quantizes a 16/32-bit checkpoint at load; this GGUF file is "
                             "already quantized (use quantization=None or 'gguf')")
        _check_fp8_device(device, "quantization='fp8'")
    return QuantizationPlan(requested, dict(weight_formats))


def _check_fp8_device(device: torch.device, what: str) -> None:
    if not has_fp8_gemm(device):
        raise ValueError(f"{what} needs FP8 GEMMs: a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         f"{device} has {torch.cuda.get_device_capability(device)}")


def _hf_quantization_scheme(config) -> Fp8CheckpointScheme | Int4CheckpointScheme | None:
    quant_config = getattr(config, "quantization_config", None)
    if quant_config is None:
        return None
    if not isinstance(quant_config, dict):
        quant_config = quant_config.to_dict() if hasattr(quant_config, "to_dict") else vars(quant_config)
    quant_method = quant_config.get("quant_method")
    if quant_method not in HF_QUANT_METHODS:
        raise ValueError(f"config.json: quantization_config.quant_method={quant_method!r} is not supported; "
                         f"supported: {list(HF_QUANT_METHODS)} (GGUF files load as .gguf)")
    if quant_method == "compressed-tensors":
        return Fp8CheckpointScheme.from_config(quant_config)
    return Int4CheckpointScheme.from_config(quant_config)


def quantized_layer_method(shard_types: dict, layer, plan: QuantizationPlan, device: torch.device,
                           dtype: torch.dtype):
    """The method of a layer whose every shard the checkpoint stores quantized (``shard_types``:
    shard id -> format), or None to keep the caller's choice (the int4 CPU method for Q4_0/Q4_1,
    or dense, dequantized at load): FP8 checkpoints load as stored, AWQ/GPTQ layers run from their
    W4G128 blocks; GGUF blocks stay blocks where the plan keeps them on ``device``."""
    formats = set(shard_types.values())
    if formats == {FP8_FORMAT}:
        return FP8_CHECKPOINT
    if W4G128 in formats:  # AWQ/GPTQ: the only way to run them (repacked, never dequantized)
        return W4G128LinearMethod(shard_types) if formats == {W4G128} else None
    if not formats <= set(GGUFBlockLinearMethod.quant_types) or not plan.keeps_gguf_blocks(device, dtype, formats):
        return None
    return GGUFBlockLinearMethod(shard_types)


def dense_layer_method(layer, plan: QuantizationPlan):
    """The method of a layer the checkpoint stores unquantized: FP8 under ``quantization="fp8"``
    (where the layer's sizes fit the FP8 GEMM), else None (dense)."""
    if plan.requested == "fp8" and Fp8LinearMethod.supports(layer):
        return FP8
    return None
