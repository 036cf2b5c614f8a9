"""FP8 W8A8 linear layers: ``LLM(quantization="fp8")`` quantizes a 16/32-bit checkpoint at load.

Each layer loads its weight in the compute dtype as the dense method would; once all its shards
are in, the weight becomes e4m3 values with one float32 scale per output row (its largest
magnitude maps to 448) and the dense copy is dropped, layer by layer, so the peak stays one dense
layer above the FP8 model. Activations are quantized per token at every call, the same math on
every path (``kernels/quant/fp8.py``'s reference): on CUDA ``kernels/quant/triton_fp8.py`` picks
by rows (a one-row GEMV for batch-size-1 decode, tensor-core GEMVs/GEMMs up to 64 rows, then the
quantizer + ``torch._scaled_mm`` with row-wise scales); the CPU emulates ``_scaled_mm``.

Layers whose sizes are not multiples of 16 (the FP8 GEMM's tile) stay dense; the LM head and the
embeddings stay in the compute dtype, as vLLM keeps them.

:class:`Fp8CheckpointLinearMethod` loads FP8 checkpoints as stored (``compressed_tensors.py``):
the e4m3 weight and its per-row scales go straight into the same buffers.

>>> configure_linears(model, lambda name, layer: FP8 if Fp8LinearMethod.supports(layer) else None)
"""
from __future__ import annotations

import torch

from hearth_llm.kernels import linear
from hearth_llm.kernels.quant import Fp8Weight
from hearth_llm.kernels.quant.fp8 import quantize_rows

from ..linear_method import LinearMethod, dense_value


class Fp8LinearMethod(LinearMethod):
    """See the module docstring; the layer ends with buffers ``weight_fp8`` ``[N, K]`` and
    ``weight_scale`` ``[N]`` (buffers, so moving the model moves them)."""

    @staticmethod
    def supports(layer) -> bool:
        return layer.input_size_per_rank % 16 == 0 and layer.output_size_per_rank % 16 == 0

    def create_weights(self, layer) -> None:
        layer.register_loadable("weight", torch.empty(layer.output_size_per_rank, layer.input_size_per_rank))

    def load_weight(self, layer, name, param, loaded, offset) -> None:
        param.data.narrow(0, offset, loaded.shape[0]).copy_(dense_value(loaded, param.dtype))

    def process_weights_after_loading(self, layer) -> None:
        weight_fp8, scale = quantize_rows(layer.weight.detach())
        del layer.weight
        layer.register_buffer("weight_fp8", weight_fp8)
        layer.register_buffer("weight_scale", scale)

    def apply(self, layer, x, bias):
        flat = x.reshape(-1, x.shape[-1])
        out = linear(flat, Fp8Weight(layer.weight_fp8, layer.weight_scale), bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])



class Fp8CheckpointLinearMethod(Fp8LinearMethod):
    """A checkpoint's e4m3 ``weight`` and float32 ``weight_scale`` ``[N, 1]``, loaded as stored.

    They load into integer tensors of the same bits (uint8, int32), because the model is cast to
    the compute dtype before loading and that cast converts every floating-point tensor.
    """

    def create_weights(self, layer) -> None:
        rows, columns = layer.output_size_per_rank, layer.input_size_per_rank
        layer.register_loadable("weight", torch.empty(rows, columns, dtype=torch.uint8))
        layer.register_loadable("weight_scale", torch.empty(rows, 1, dtype=torch.int32))

    def checkpoint_shape(self, layer, name, num_rows):
        return (num_rows, 1) if name == "weight_scale" else (num_rows, layer.input_size)

    def narrow_input(self, loaded, start: int, size: int):
        # weight_scale [rows, 1] is per output row: a row-parallel rank keeps it whole.
        return loaded if loaded.dtype != torch.float8_e4m3fn and loaded.shape[1] == 1 else loaded.narrow(1, start, size)

    def load_weight(self, layer, name, param, loaded, offset) -> None:
        if name == "weight":
            if loaded.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{layer.prefix}.weight is {loaded.dtype}; the checkpoint's quantization_config "
                                 "says float8_e4m3fn")
            bits = loaded.view(torch.uint8)
        else:
            bits = loaded.float().contiguous().view(torch.int32)
        param.data.narrow(0, offset, loaded.shape[0]).copy_(bits)

    def process_weights_after_loading(self, layer) -> None:
        weight, scale = layer.weight, layer.weight_scale
        del layer.weight, layer.weight_scale
        layer.register_buffer("weight_fp8", weight.data.view(torch.float8_e4m3fn))
        layer.register_buffer("weight_scale", scale.data.view(torch.float32).reshape(-1))


FP8 = Fp8LinearMethod()
FP8_CHECKPOINT = Fp8CheckpointLinearMethod()
