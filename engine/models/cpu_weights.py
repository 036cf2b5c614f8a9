"""CPU copies of a bf16 weight laid out for fast matmuls: a linear layer's (:class:`CpuLinear`)
and the vocabulary projection's (:class:`CpuLogitsHead`); from a GGUF file's blocks, the head's
(:class:`CpuBlockLogitsHead`) and the token embedding's (:class:`CpuBlockEmbedding`)."""
from __future__ import annotations

import functools

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
    # Without a dense copy (``packed_weight`` None), batches from this many rows decode tiles of the
    # int4 codes for oneDNN (``int4_tiled_linear``); fewer stay on the int4 kernel. Measured
    # ([1536, 576], 1 thread, CPU ms): 32 rows int4 1.07 vs tiles 2.98; 500 rows 14.7 vs 4.4.
    INT4_TILES_MIN_ROWS = 96

    def __init__(self, packed_weight: torch.Tensor | None, int4: tuple | None) -> None:
        super().__init__()
        self.packed_weight = packed_weight
        self.int4 = int4

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.int4 is not None and self.packed_weight is None and x.shape[0] >= self.INT4_TILES_MIN_ROWS \
                and int4_tiles_available(self.int4):
            return int4_tiled_linear(x, *self.int4, bias=bias)
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
        if dense is None and int4_tiles_available(self.int4):
            int4pack_mm, (packed, scales_and_zeros) = torch.ops.aten._weight_int4pack_mm_for_cpu.default, self.int4
            group_size, min_tile_rows = cpu_ops.INT4_GROUP_SIZE, self.INT4_TILES_MIN_ROWS

            def int4_or_tiles(x: torch.Tensor) -> torch.Tensor:
                if x.shape[0] >= min_tile_rows:
                    return int4_tiled_linear(x, packed, scales_and_zeros, bias)
                out = int4pack_mm(x, packed, group_size, scales_and_zeros)
                return out if bias is None else out.add_(bias)

            return int4_or_tiles
        if dense is None:
            return kernels.linear_routine(kernels.Int4Weight(*self.int4), "cpu", bias)
        return cpu_ops.int4_or_dense_linear_routine(*self.int4, cpu_ops.INT4_GROUP_SIZE, self.packed_weight, bias,
                                                    self.INT4_MAX_ROWS)


# Values per dequantized tile of an int4 weight in a large batch (4 MiB of float32).
INT4_TILE_ELEMENTS = 1 << 20


def int4_tiles_available(int4: tuple) -> bool:
    """Whether large batches can run an int4 weight (``(packed, scales_and_zeros)``) tile by tile from
    its own codes (:func:`int4_tiled_linear`) instead of a dense copy: the C kernels are built and the
    weight's rows come in the layout's blocks of 64, and torch packs in the layout they read."""
    return (int4[1].shape[1] % 64 == 0 and int4[1].dtype == torch.bfloat16 and gguf_cpu_native.available()
            and int4_layout_is_the_tiles_one())


@functools.cache
def int4_layout_is_the_tiles_one() -> bool:
    """Whether ``_convert_weight_to_int4pack_for_cpu`` packs in the layout the C tile decoder reads
    (AVX-512 builds': rows in blocks of 64). Torch's AVX2 kernels pack blocks of 32 rows another way,
    so there tiles would hold the wrong weights; checked once, on a 64 x 32 weight, against the
    values torch's int4 kernel multiplies by."""
    if not gguf_cpu_native.available() or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return False
    codes = torch.randint(0, 16, (64, 32), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.stack((torch.ones(1, 64), torch.zeros(1, 64)), dim=-1).bfloat16()
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(32).bfloat16(), packed, 32, scales_and_zeros)
    tile = gguf_cpu_native.int4pack_dequantize_t(packed, scales_and_zeros, 32, 0, 64)
    return torch.equal(tile, kernel.float()) and torch.equal(tile, (codes - 8).float().T)


def int4_tiled_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                      bias: torch.Tensor | None = None, group_size: int = cpu_ops.INT4_GROUP_SIZE) -> torch.Tensor:
    """``x @ W.T + bias`` for many rows of ``x`` and an int4 CPU weight: each tile of ``W``'s rows is
    dequantized (the values the int4 kernel multiplies by), cast to ``x``'s dtype and multiplied by
    oneDNN, so no dense copy of the weight is kept; the decoding is paid once per call."""
    num_rows = scales_and_zeros.shape[1]
    num_columns = scales_and_zeros.shape[0] * group_size
    rows_per_tile = max(64, INT4_TILE_ELEMENTS // num_columns // 64 * 64)
    out = torch.empty(x.shape[0], num_rows, dtype=x.dtype)
    for start in range(0, num_rows, rows_per_tile):
        stop = min(num_rows, start + rows_per_tile)
        tile = gguf_cpu_native.int4pack_dequantize_t(packed, scales_and_zeros, group_size, start, stop).to(x.dtype)
        out[:, start:stop] = x @ tile  # tile: [K, rows] (the transposed layout decodes 16 rows per vector)
        if bias is not None:
            out[:, start:stop] += bias[start:stop]
    return out


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
        self.weight = None  # no dense copy
        self.register_buffer("blocks", blocks.data)  # resident_blocks' copy, shared with a tied embedding
        self.routine = gguf_cpu.gguf_linear_routine([(self.quant_type, self.blocks)])
        # bf16 hidden states straight into the bf16 kernel (Q4_K/Q6_K), float32 logits out
        self.bf16_gemv = gguf_cpu_native.gemv_routine(self.blocks, self.quant_type, bf16=True) \
            if gguf_cpu_native.has_bf16(self.quant_type) else None
        self.int8_gemv = None  # use_int8_activations

    def use_int8_activations(self) -> bool:
        """``EngineConfig.cpu_int8_activations``: steps of up to ``gguf_cpu_q8x.MAX_ROWS`` rows multiply the
        blocks by x quantized to int8 per block of 32 (``kernels/quant/gguf_cpu_q8x.py``; not exact, each
        row's bits independent of the step's rows), float32 logits. False where the type has no such kernel."""
        from hearth_llm.kernels.quant import gguf_cpu_q8x

        if not gguf_cpu_q8x.supports(self.quant_type, self.blocks.shape[0]):
            return False
        self.int8_gemv = gguf_cpu_q8x.weight_routine(self.blocks, self.quant_type)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.reshape(-1, x.shape[-1]).shape[0]
        if self.int8_gemv is not None and 0 < num_rows <= 8 and x.dtype in (torch.bfloat16, torch.float32):
            return self.int8_gemv(x.reshape(-1, x.shape[-1]).contiguous()).reshape(*x.shape[:-1], self.out_features)
        if self.bf16_gemv is not None and x.dtype == torch.bfloat16 and 0 < num_rows <= gguf_cpu.BF16_MAX_ROWS:
            # the bf16 kernels give each row the same bits in any batch: all rows in one pass
            return self.bf16_gemv(x.reshape(-1, x.shape[-1]).contiguous()).reshape(*x.shape[:-1], self.out_features)
        if 2 < num_rows <= gguf_cpu_native.MAX_ROWS and self.routine is not None:
            # Two rows a call, as a decode step's one row is computed (the C GEMV keeps the same
            # accumulators for 1-2 rows, fewer for more): a speculative verify step's or a batch's
            # rows round exactly as alone, so greedy near-ties do not flip. Same cost here (Q8_0).
            rows = x.reshape(-1, x.shape[-1])
            return torch.cat([self(rows[i:i + 2]) for i in range(0, num_rows, 2)]).reshape(*x.shape[:-1], -1)
        x32 = x.float()
        if self.routine is not None and 0 < num_rows <= gguf_cpu_native.MAX_ROWS:
            return self.routine(x32)
        return gguf_cpu.gguf_linear(x32, self.blocks, self.quant_type)

    def resident_bytes(self) -> int:
        return self.blocks.numel()


class CpuBlockEmbedding(nn.Module):
    """The token embedding from the GGUF file's blocks: a lookup decodes just the rows it reads
    (exactly, as the reference does) and casts them to the compute dtype, the values a dequantized
    embedding would hold. A tied LM head shares the same bytes (:class:`CpuBlockLogitsHead`).

    Made by :func:`cpu_block_embedding` while the embedding's weight loads.
    """

    def __init__(self, embedding: nn.Embedding, blocks) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.quant_type = blocks.quant_type
        self.register_buffer("blocks", blocks.data)
        # what code reading the embedding's dtype and device sees (no values: the bytes are above)
        self.register_buffer("weight", torch.empty(0, dtype=embedding.weight.dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1))
        values = gguf_cpu_native.dequantize(rows, self.quant_type, num_threads=1).to(self.weight.dtype)
        return values.reshape(*input_ids.shape, self.embedding_dim)

    def resident_bytes(self) -> int:
        return self.blocks.numel()


def resident_blocks(loaded, dtype: torch.dtype):
    """A checkpoint value the CPU embedding/head may keep as blocks: GGUF blocks of a bf16 model (of a
    float32 one: the types with a vectorized float32 GEMV, e.g. AVX2's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K), in their natural column order, with
    the C kernels built, copied out of the loader's buffer (which may be a view of its whole mapped
    file, kept resident as long as any view lives); else None."""
    quant_type = getattr(loaded, "quant_type", None)
    if (quant_type not in GGUF_TYPES or getattr(loaded, "input_order", 1) is not None
            or not (dtype == torch.bfloat16 or (dtype == torch.float32 and gguf_cpu_native.has_vector_float32(quant_type)))
            or loaded.data.device.type != "cpu" or not gguf_cpu_native.available()):
        return None
    return type(loaded)(loaded.quant_type, loaded.data.clone(memory_format=torch.contiguous_format))


def cpu_block_embedding(embedding: nn.Module, blocks) -> nn.Module:
    """``embedding`` (an ``nn.Embedding``) as a :class:`CpuBlockEmbedding` of ``blocks`` (from
    :func:`resident_blocks`), else as it is."""
    if blocks is None or type(embedding) is not nn.Embedding or embedding.weight.device.type != "cpu" \
            or tuple(blocks.shape) != tuple(embedding.weight.shape):
        return embedding
    return CpuBlockEmbedding(embedding, blocks)


def cpu_logits_head(head: nn.Module, blocks=None) -> nn.Module:
    """The logits-head method: ``head`` (a loaded ``nn.Linear``) as a :class:`CpuBlockLogitsHead`
    when the checkpoint stored its weight as GGUF ``blocks`` (from :func:`resident_blocks`), else as a :class:`CpuLogitsHead` where that is faster (a bf16 weight on a CPU
    with bf16 oneDNN, no bias), else ``head`` itself."""
    if type(head) is not nn.Linear or head.bias is not None or head.weight.device.type != "cpu":
        return head
    if (blocks is not None and head.weight.dtype in (torch.bfloat16, torch.float32)
            and tuple(blocks.shape) == tuple(head.weight.shape)):
        return CpuBlockLogitsHead(head, blocks)
    packed = cpu_ops.pack_dense_weight(head.weight)
    if packed is None:
        return head
    rows_per_block = max(1, CpuLogitsHead.FP16_PACK_BYTES // (4 * head.weight.shape[1]))
    blocks = [cpu_ops.pack_fp16_weight(rows) for rows in head.weight.split(rows_per_block)]
    return CpuLogitsHead(head, packed, None if any(block is None for block in blocks) else blocks)
