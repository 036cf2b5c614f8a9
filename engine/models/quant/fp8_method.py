"""FP8 W8A8 linear layers: ``LLM(quantization="fp8")`` quantizes a 16/32-bit checkpoint at load.

Each layer loads its weight in the compute dtype as the dense method would; once all its shards
are in, the weight becomes e4m3 values with one float32 scale per output row (its largest
magnitude maps to 448) and the dense copy is dropped, layer by layer, so the peak stays one dense
layer above the FP8 model. Activations are quantized per token at every call
(``kernels/quant/fp8.py``): ``torch._scaled_mm`` with row-wise scales (Hopper; the CPU emulates it).

Layers whose sizes are not multiples of 16 (the FP8 GEMM's tile) stay dense; the LM head and the
embeddings stay in the compute dtype, as vLLM keeps them.

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


FP8 = Fp8LinearMethod()
