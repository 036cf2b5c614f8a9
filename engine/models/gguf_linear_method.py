"""GGUF Q4_0/Q4_1 weights on the CPU as 4-bit weights, packed straight from llama.cpp's blocks.

Chosen before loading for a linear layer whose every checkpoint shard is a Q4_0 or Q4_1 tensor
(the checkpoint says so in ``weight_formats``). Loading takes each shard's codes and scales from
its blocks (exact) into torch's int4 CPU layout, which decode steps of a few rows read: a quarter
of a bf16 weight's bytes. Batches of 96+ rows decode tiles of those codes for oneDNN (the C kernels of
``kernels/quant/gguf_cpu_native.py``), so the layer holds only its 4-bit copy (~1.0-1.1x the file's
bytes); where those are not built, a bf16 copy in oneDNN's layout, dequantized from the same blocks. The old path (dequantize, then search the dense weight for a 4-bit grid) is gone for
GGUF files.

>>> configure_linears(model, lambda name, layer: GGUF_INT4 if GGUFInt4LinearMethod.supports(layer, "cpu", bf16) else None)
"""
from __future__ import annotations

import torch

from hearth_llm.engine.loader.gguf_blocks import BLOCK_SIZE, KEPT_TYPES, GGUFBlocks
from hearth_llm.kernels import cpu_ops
from hearth_llm.kernels.quant import gguf_cpu_native

from .cpu_weights import CpuLinear
from .linear_method import LinearMethod


class GGUFInt4LinearMethod(LinearMethod):
    """See the module docstring. ``value = (code - 8) * scale + zero`` per block of 32 inputs:
    Q4_0 is ``scale = d, zero = 0``, Q4_1 ``scale = d, zero = m + 8 d``; the kernel holds scales
    and zeros in the compute dtype (bf16)."""

    # llama.cpp types whose blocks this method packs.
    quant_types = KEPT_TYPES

    @staticmethod
    def supports(layer, device: torch.device | str, dtype: torch.dtype) -> bool:
        """Whether the int4 CPU kernel can run this layer (bf16 on the CPU, whole blocks, rows in 16s)."""
        return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
                and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
                and layer.input_size_per_rank % BLOCK_SIZE == 0 and layer.output_size_per_rank % 16 == 0)

    def create_weights(self, layer) -> None:
        # Without the C kernels, large batches read a dense bf16 copy; with them, tiles decoded from
        # the int4 codes (``cpu_weights.int4_tiled_linear``), so the dense weight is never made.
        rows = layer.output_size_per_rank if not _tiles_from_codes(layer) else 0
        layer.register_loadable("weight", torch.empty(rows, layer.input_size_per_rank if rows else 0))

    def load_weight(self, layer, name, param, loaded, offset) -> None:
        if not isinstance(loaded, GGUFBlocks):
            raise ValueError(f"{layer.prefix} was set up for GGUF {'/'.join(self.quant_types)} blocks (from the "
                             f"file's tensor types), got {type(loaded).__name__}")
        rows = loaded.shape[0]
        if param.numel():
            param.data.narrow(0, offset, rows).copy_(loaded.dequantized(torch.float32))
        codes, scales, zeros = _int4_parts(layer)
        shard_codes, shard_scales, shard_zeros = loaded.int4_parts()
        codes.narrow(0, offset, rows).copy_(shard_codes)
        scales.narrow(0, offset, rows).copy_(shard_scales)
        zeros.narrow(0, offset, rows).copy_(shard_zeros)

    def process_weights_after_loading(self, layer) -> None:
        codes, scales, zeros = layer.__dict__.pop("_int4_parts")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        del codes
        # The kernel reads [num_groups, rows, (scale, zero)].
        scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(layer.weight.dtype)
        dense = cpu_ops.pack_dense_weight(layer.weight) if layer.weight.numel() else None
        layer.cpu_weight = CpuLinear(dense, (packed, scales_and_zeros))
        del layer.weight

    def apply(self, layer, x, bias):
        return layer.cpu_weight(x, bias)

    def forward_routine(self, layer):
        return layer.cpu_weight.routine(layer.bias)


# Whether pure Q4_0/Q4_1 layers drop their dense copy (prefill then runs the int4 codes: the int4 kernel up
# to INT4_TILES_MIN_ROWS rows, decoded tiles from there). Off: the int4 layout holds the block scales rounded
# to bf16, so a prefill of 9-95 rows on it is not the file's weights, and the bundled SmolLM2's greedy answer
# to "What is the capital of France?" changed ("The capital of France is Paris." -> "L'Étoile, la
# Marseillaise,"). With the dense copy, prefill multiplies the exactly dequantized weights, as before.
DROP_DENSE_COPY = False


def _tiles_from_codes(layer) -> bool:
    """Whether large batches will decode tiles from the int4 codes (see ``CpuLinear``): only with
    ``DROP_DENSE_COPY``, where the C kernels are built and the rows come in the int4 layout's blocks of 64."""
    return DROP_DENSE_COPY and layer.output_size_per_rank % 64 == 0 and gguf_cpu_native.available()


def _int4_parts(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's codes/scales/zeros being filled shard by shard (made on the first shard)."""
    parts = layer.__dict__.get("_int4_parts")
    if parts is None:
        rows, columns = layer.output_size_per_rank, layer.input_size_per_rank
        device = layer.weight.device
        parts = (torch.empty(rows, columns, dtype=torch.uint8, device=device),
                 torch.empty(rows, columns // BLOCK_SIZE, device=device),
                 torch.empty(rows, columns // BLOCK_SIZE, device=device))
        layer.__dict__["_int4_parts"] = parts
    return parts


GGUF_INT4 = GGUFInt4LinearMethod()
