"""CPU copies of a bf16 weight laid out for fast matmuls: a linear layer's (:class:`CpuLinear`)
and the vocabulary projection's (:class:`CpuLogitsHead`, or :class:`CpuBlockLogitsHead` from a GGUF
file's blocks)."""
from __future__ import annotations

import torch
from torch import nn

from hearth_llm import kernels
from hearth_llm.kernels import cpu_ops
from hearth_llm.kernels.quant import GGUF_TYPES, gguf_cpu, gguf_cpu_native


class CpuLinear(nn.Module):
    """A linear layer's weight for CPU matmuls, made by its linear method after loading.

    Batches use a copy in oneDNN's blocked layout. Steps of a few rows (decoding a few sequences)
    are bound by reading the weight from memory, so where a 4-bit copy holds the same values
    (``int4``: from a Q4 GGUF file) they read that: a quarter of the bytes.

    >>> cpu = CpuLinear(cpu_ops.pack_dense_weight(w), None)
    >>> cpu(x, bias=None)      # == F.linear(x, w)
    """

    # Above this many rows the 4-bit kernel's unpacking costs more than its smaller reads save.
    # Measured on the bundled SmolLM2 (Q4_1), its 120 linears in layer order, 1 thread, CPU time,
    # interleaved (Xeon with AMX, 2 cores shared, load 10-12): int4/bf16 ms per pass 0.34 at 1 row,
    # 0.52-0.76 at 5 (a k=4 verify step), 0.69-1.04 at 6, 0.88-1.14 at 8, 1.42-2.14 at 9-16.
    # So verification steps of up to 8 rows (k <= 7) read the int4 copy.
    INT4_MAX_ROWS = 8

    def __init__(self, packed_weight: torch.Tensor | None, int4: tuple | None) -> None:
        super().__init__()
        self.packed_weight = packed_weight
        self.int4 = int4

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.int4 is not None and (x.shape[0] <= self.INT4_MAX_ROWS or self.packed_weight is None):
            return cpu_ops.int4_linear(x, *self.int4, bias=bias)
        return cpu_ops.dense_linear(x, self.packed_weight, bias)

    def routine(self, bias: torch.Tensor | None):
        """``x -> forward(x, bias)`` with the kernels chosen and the tensors bound now, for the
        layer's forward to call (see ``LinearMethod.forward_routine``)."""
        dense = None
        if self.packed_weight is not None:
            num_rows, num_inputs = self.packed_weight.shape  # oneDNN keeps the logical [N, K] shape
            dense = kernels.linear_routine(kernels.OnednnBf16Weight(self.packed_weight, num_rows, num_inputs), "cpu",
                                           bias)
        if self.int4 is None:
            return dense
        if dense is None:
            return kernels.linear_routine(kernels.Int4Weight(*self.int4), "cpu", bias)
        return cpu_ops.int4_or_dense_linear_routine(*self.int4, cpu_ops.INT4_GROUP_SIZE, self.packed_weight, bias,
                                                    self.INT4_MAX_ROWS)


class CpuLogitsHead(nn.Module):
    """The vocabulary projection of a bf16 model on the CPU, with float32 logits.

    Logits rounded to bf16 lie 1/16 apart near typical top values, so greedy choices between close
    tokens would follow the rounding. A step of a few rows reads the weight from fbgemm's fp16 copy,
    which is both faster and more exact. Larger batches use the bf16 copy and then recompute their
    ``NUM_EXACT_TOP`` best logits in float32, where every choice is made.

    Made by :func:`cpu_logits_head` once the head's weight is loaded.
    """

    FP16_MAX_ROWS = 4
    NUM_EXACT_TOP = 8
    # Packing the fp16 copy goes through a float32 copy of the rows packed, which for a whole
    # 128k x 4096 vocabulary would be a 2 GB spike at load; so rows are packed in blocks whose
    # float32 copy stays under this. Each block is a separate matmul call, and in a decode step
    # every extra block costs (SmolLM2's head: 5.9 ms/step whole, 7.1 ms in 6 blocks of 8192
    # rows), so the bound is as large as the load-memory goal allows: heads up to 128 MiB in
    # float32 (SmolLM2's 49152 x 576 is 108 MiB) pack whole.
    FP16_PACK_BYTES = 128 << 20

    def __init__(self, linear: nn.Linear, packed_weight: torch.Tensor, fp16_weight) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # tied models share it with the embedding: no copy
        self.packed_weight = packed_weight
        self.fp16_weight = fp16_weight  # a list of packed row blocks, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp16_weight is not None and x.shape[0] <= self.FP16_MAX_ROWS:
            if len(self.fp16_weight) == 1:
                return cpu_ops.fp16_linear(x, self.fp16_weight[0])
            return torch.cat([cpu_ops.fp16_linear(x, block) for block in self.fp16_weight], dim=-1)
        logits = cpu_ops.dense_linear(x, self.packed_weight).float()
        top = cpu_ops.topk_indices(logits, min(self.NUM_EXACT_TOP, logits.shape[-1]))
        exact = torch.linalg.vecdot(self.weight[top].float(), x.float()[:, None, :])
        return logits.scatter_(1, top, exact)


class CpuBlockLogitsHead(nn.Module):
    """The vocabulary projection from the GGUF file's blocks (``kernels/quant/gguf_cpu.py``): float32
    logits, from the exactly decoded weight in float32 (the C GEMV for decode-sized steps, a tiled
    float32 matmul for more rows). Keeps only the file's bytes: an 8-bit or 6-bit head is a third to
    a half of one bf16 copy, and :class:`CpuLogitsHead` keeps two copies besides the weight.

    Made by :func:`cpu_logits_head` when the loader handed the head's weight over as blocks.
    """

    def __init__(self, linear: nn.Linear, blocks) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.quant_type = blocks.quant_type
        self.weight = None  # no dense copy (a tied embedding keeps its own)
        # a copy: the loader's tensor may be a view of its whole mapped file, which it would keep resident
        self.register_buffer("blocks", blocks.data.clone(memory_format=torch.contiguous_format))
        self.routine = gguf_cpu.gguf_linear_routine([(self.quant_type, self.blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.routine is not None and 0 < x32.reshape(-1, x32.shape[-1]).shape[0] <= gguf_cpu_native.MAX_ROWS:
            return self.routine(x32)
        return gguf_cpu.gguf_linear(x32, self.blocks, self.quant_type)

    def resident_bytes(self) -> int:
        return self.blocks.numel()


def cpu_logits_head(head: nn.Module, blocks=None) -> nn.Module:
    """The logits-head method: ``head`` (a loaded ``nn.Linear``) as a :class:`CpuBlockLogitsHead`
    when the checkpoint stored its weight as GGUF ``blocks`` (a bf16 model on the CPU, where the C
    kernels are built), else as a :class:`CpuLogitsHead` where that is faster (a bf16 weight on a CPU
    with bf16 oneDNN, no bias), else ``head`` itself."""
    if type(head) is not nn.Linear or head.bias is not None or head.weight.device.type != "cpu":
        return head
    if (blocks is not None and head.weight.dtype == torch.bfloat16 and blocks.input_order is None
            and blocks.quant_type in GGUF_TYPES and tuple(blocks.shape) == tuple(head.weight.shape)
            and gguf_cpu_native.available()):
        return CpuBlockLogitsHead(head, blocks)
    packed = cpu_ops.pack_dense_weight(head.weight)
    if packed is None:
        return head
    rows_per_block = max(1, CpuLogitsHead.FP16_PACK_BYTES // (4 * head.weight.shape[1]))
    blocks = [cpu_ops.pack_fp16_weight(rows) for rows in head.weight.split(rows_per_block)]
    return CpuLogitsHead(head, packed, None if any(block is None for block in blocks) else blocks)
