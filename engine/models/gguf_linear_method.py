"""GGUF Q4_0/Q4_1 (and, in float32, Q8_0) weights on the CPU: decode steps on the file's blocks (exact),
batches on a dense copy.

Chosen before loading for a linear layer whose every checkpoint shard is a Q4_0 or Q4_1 tensor, or in
float32 also Q8_0 (the checkpoint says so in ``weight_formats``; in bf16 a Q8_0 layer runs
``GGUFBlockLinearMethod``'s bf16 kernels). In float32 (CPUs without AVX-512 BF16) where the AVX2 panel
kernels are built, the blocks are repacked into panels of 8 rows for decode steps. Where this machine's C kernels have the bf16 Q4
kernels (AVX-512 BF16, ``kernels/quant/gguf_cpu_native.py``), the layer keeps the file's blocks (a
uint8 buffer per run of same-type shards, as ``GGUFBlockLinearMethod``) and steps of up to
``gguf_cpu_native.MAX_ROWS`` rows (decode, speculative verification) multiply them in place: the
file's fp16 block scales, not rounded. Elsewhere it packs the blocks' codes into torch's int4 CPU layout
(``_weight_int4pack_mm_for_cpu``, whose scales and zeros are bf16: the file's fp16 scales rounded).
Batches of more rows: with AMX, tiles decoded from the kept blocks into L2 and multiplied there
(:func:`amx_batches`; the same bf16 products as a dense copy), so the layer holds the file's bytes only;
without AMX, a bf16 copy dequantized from the same blocks (``DROP_DENSE_COPY``, ``DENSE_COPY_WITH_AMX``).

>>> configure_linears(model, lambda name, layer: GGUF_INT4 if GGUFInt4LinearMethod.supports(layer, "cpu", bf16) else None)
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from hearth_llm.engine.loader.gguf_blocks import BLOCK_SIZE, KEPT_TYPES, GGUFBlocks
from hearth_llm.kernels import cpu_ops
from hearth_llm.kernels.cpu_step_native import StepRun
from hearth_llm.kernels.quant import gguf_cpu, gguf_cpu_native

from .cpu_weights import CpuLinear
from .linear_method import LinearMethod


class GGUFInt4LinearMethod(LinearMethod):
    """See the module docstring. ``value = (code - 8) * scale + zero`` per block of 32 inputs:
    Q4_0 is ``scale = d, zero = 0``, Q4_1 ``scale = d, zero = m + 8 d``; the kernel holds scales
    and zeros in the compute dtype (bf16)."""

    # llama.cpp types whose layers this method takes: Q4_0/Q4_1 (int4 codes, bf16 blocks, float32 panels)
    # and Q8_0 (float32 panels; elsewhere its dense copy alone).
    quant_types = KEPT_TYPES + ("Q8_0",)

    @staticmethod
    def supports(layer, device: torch.device | str, dtype: torch.dtype) -> bool:
        """Whether the int4 CPU kernel can run this layer (bf16 on the CPU, whole blocks, rows in 16s),
        or in float32 the panel kernels (AVX2: each shard's rows in 8s)."""
        if torch.device(device).type == "cpu" and dtype == torch.float32:
            return (_has_panels() and layer.input_size_per_rank % BLOCK_SIZE == 0
                    and all(rows % gguf_cpu_native.PANEL_ROWS == 0 for rows in layer.output_sizes_per_rank))
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
        # untouched (so never resident) where no dense copy will be kept: bf16 batches on AMX tiles, and float32
        # layers whose shards all go to panels (FLOAT32_DENSE_COPY off), which dequantizing cost ~10 s of a 1B
        # Q8_0 file's load
        panels_only = (param.dtype == torch.float32 and not FLOAT32_DENSE_COPY and _has_panels()
                       and loaded.input_order is None)
        if param.numel() and not _batches_on_amx(layer, param.dtype) and not panels_only:
            param.data.narrow(0, offset, rows).copy_(loaded.dequantized(torch.float32))
        elif param.numel():
            layer.__dict__["_gguf_dense_skipped"] = True
        if _exact_blocks(loaded.quant_type, param.dtype) and loaded.input_order is None:
            layer.__dict__.setdefault("_gguf_shards", []).append((offset, loaded.quant_type, loaded.data.clone()))
            return
        if loaded.quant_type not in KEPT_TYPES:  # Q8_0 without its kernels: the dense copy only
            layer.__dict__["_gguf_dense_only"] = True
            return
        codes, scales, zeros = _int4_parts(layer)
        shard_codes, shard_scales, shard_zeros = loaded.int4_parts()
        codes.narrow(0, offset, rows).copy_(shard_codes)
        scales.narrow(0, offset, rows).copy_(shard_scales)
        zeros.narrow(0, offset, rows).copy_(shard_zeros)

    def process_weights_after_loading(self, layer) -> None:
        shards = layer.__dict__.pop("_gguf_shards", None)
        if layer.__dict__.pop("_gguf_dense_only", False):  # a shard had no kernel here: all rows dense
            if layer.__dict__.pop("_gguf_dense_skipped", False):
                raise RuntimeError(f"{layer.prefix}: a shard needs the dense copy that an earlier shard skipped")
            layer.__dict__.pop("_int4_parts", None)
            dense = cpu_ops.pack_dense_weight(layer.weight)
            layer.cpu_weight = None if dense is None else CpuLinear(dense, None)
            if dense is not None:
                del layer.weight
            return
        if shards is not None and "_int4_parts" not in layer.__dict__:
            # Runs of consecutive shards of one type, each one buffer of the file's block rows.
            runs = []
            for offset, quant_type, data in sorted(shards, key=lambda shard: shard[0]):
                if runs and runs[-1][0] == quant_type:
                    runs[-1][1].append(data)
                else:
                    runs.append((quant_type, [data]))
            if layer.weight.dtype == torch.float32:
                # float32: the blocks as panels for decode steps; batches multiply tiles decoded from the
                # panels (FLOAT32_DENSE_COPY off: the layer holds the file's bytes only).
                layer.gguf_panel_runs = []
                for index, (quant_type, parts) in enumerate(runs):
                    name = f"gguf_panels_{index}"
                    layer.register_buffer(name, gguf_cpu_native.pack_panels(torch.cat(parts), quant_type))
                    layer.gguf_panel_runs.append((quant_type, name))
                layer.cpu_weight = None
                if not FLOAT32_DENSE_COPY:
                    del layer.weight
                return
        amx = shards is not None and "_int4_parts" not in layer.__dict__ and _batches_on_amx(layer, layer.weight.dtype)
        dense = cpu_ops.pack_dense_weight(layer.weight) if layer.weight.numel() and not amx else None
        if shards is not None and "_int4_parts" not in layer.__dict__:
            layer.gguf_block_runs = []
            for index, (quant_type, parts) in enumerate(runs):
                name = f"gguf_blocks_{index}"
                layer.register_buffer(name, parts[0] if len(parts) == 1 else torch.cat(parts))
                layer.gguf_block_runs.append((quant_type, name))
            layer.cpu_weight = CpuLinear(dense, None) if dense is not None else None
            layer.gguf_batches_on_amx = amx
            del layer.weight
            return
        codes, scales, zeros = layer.__dict__.pop("_int4_parts")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        del codes
        # The kernel reads [num_groups, rows, (scale, zero)].
        scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(layer.weight.dtype)
        layer.cpu_weight = CpuLinear(dense, (packed, scales_and_zeros))
        del layer.weight

    def block_runs(self, layer) -> list[tuple[str, torch.Tensor]] | None:
        """``[(quant_type, block rows), ...]`` in output-row order where the layer kept the file's blocks."""
        runs = getattr(layer, "gguf_block_runs", None)
        return None if runs is None else [(quant_type, getattr(layer, name)) for quant_type, name in runs]

    def panel_runs(self, layer) -> list[tuple[str, torch.Tensor]] | None:
        """``[(quant_type, panels), ...]`` in output-row order where the float32 layer keeps panels."""
        runs = getattr(layer, "gguf_panel_runs", None)
        return None if runs is None else [(quant_type, getattr(layer, name)) for quant_type, name in runs]

    def resident_bytes(self, layer) -> int:
        """Bytes of the layer's weight copies: the blocks (or panels, or int4 codes and scales) and the dense copy."""
        total = sum(data.numel() for _, data in (self.block_runs(layer) or []) + (self.panel_runs(layer) or []))
        if self.panel_runs(layer) is not None and "weight" in layer._parameters:
            total += layer.weight.numel() * layer.weight.element_size()
        cpu = getattr(layer, "cpu_weight", None)
        if cpu is not None:
            for tensor in ([cpu.packed_weight] if cpu.packed_weight is not None else []) + list(cpu.int4 or ()):
                total += tensor.numel() * tensor.element_size()
        return total

    def apply(self, layer, x, bias):
        if getattr(layer, "cpu_weight", None) is None and "weight" in layer._parameters:  # dense only, plain
            return F.linear(x, layer.weight, bias)
        if self.panel_runs(layer) is not None:
            return _panel_routine(self.panel_runs(layer), layer._parameters.get("weight"), bias)(x)
        runs = self.block_runs(layer)
        if runs is None:
            return layer.cpu_weight(x, bias)
        flat = x.reshape(-1, x.shape[-1])
        if getattr(layer, "gguf_batches_on_amx", False) and flat.shape[0] > gguf_cpu_native.MAX_ROWS:
            return amx_batches(runs, bias)(x)
        if flat.shape[0] <= gguf_cpu_native.MAX_ROWS or layer.cpu_weight is None:
            outs = [gguf_cpu.gguf_linear(flat, data, quant_type) for quant_type, data in runs]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            out = out if bias is None else out.add_(bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return layer.cpu_weight(x, bias)

    def cpu_step_runs(self, layer, dtype):
        panels = self.panel_runs(layer)
        if panels is not None:  # the float32 routine's steps of up to PANEL_MAX_ROWS rows
            return ([StepRun(quant_type, data, panels=True) for quant_type, data in panels]
                    if dtype == torch.float32 and PANEL_MAX_ROWS >= gguf_cpu_native.MAX_ROWS else None)
        return gguf_cpu.step_runs(self.block_runs(layer), dtype)

    def forward_routine(self, layer):
        if self.panel_runs(layer) is not None:
            return _panel_routine(self.panel_runs(layer), layer._parameters.get("weight"), layer.bias)
        runs = self.block_runs(layer)
        if runs is None:
            return None if layer.cpu_weight is None else layer.cpu_weight.routine(layer.bias)
        exact = gguf_cpu.gguf_linear_routine(runs, layer.bias)
        if getattr(layer, "gguf_batches_on_amx", False):
            dense = amx_batches(runs, layer.bias, exact)  # batches on tiles of the blocks: no dense copy
        else:
            dense = None if layer.cpu_weight is None else layer.cpu_weight.routine(layer.bias)
        if dense is None:
            return exact
        max_rows, bias = gguf_cpu_native.MAX_ROWS, layer.bias
        if len(runs) == 1:
            # One run (the usual case): the kernel writes bf16 straight out, one call per step (a
            # decode step runs ~120 of these: each torch op saved is ~1-2 us x 120).
            gemv = gguf_cpu_native.gemv_routine(runs[0][1], runs[0][0], bf16_out=True)

            def blocks_or_dense(x: torch.Tensor) -> torch.Tensor:
                if x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.dtype == torch.bfloat16 and x.is_contiguous():
                    out = gemv(x)
                    return out if bias is None else out.add_(bias)
                return exact(x) if 0 < x.numel() <= max_rows * x.shape[-1] else dense(x)

            return blocks_or_dense

        def exact_or_dense(x: torch.Tensor) -> torch.Tensor:
            return exact(x) if 0 < x.numel() <= max_rows * x.shape[-1] else dense(x)

        return exact_or_dense


# Whether pure Q4_0/Q4_1 layers drop their dense copy (prefill then runs the int4 codes: the int4 kernel up
# to INT4_TILES_MIN_ROWS rows, decoded tiles from there). Off: the int4 layout holds the block scales rounded
# to bf16, so a prefill of 9-95 rows on it is not the file's weights, and the bundled SmolLM2's greedy answer
# to "What is the capital of France?" changed ("The capital of France is Paris." -> "L'Étoile, la
# Marseillaise,"). With the dense copy, prefill multiplies the exactly dequantized weights, as before.
DROP_DENSE_COPY = False
# With the file's blocks kept (AVX-512 BF16), decode-sized steps of up to gguf_cpu_native.MAX_ROWS rows run
# the exact C kernel and larger ones the dense copy. Measured on the bundled SmolLM2 (its 120 linears, 1
# thread, CPU ms per pass, the three interleaved so each runs cold as in a decode step, load 0.8): exact /
# int4 kernel / dense bf16 9.23 / 9.06 / 23.97 at 1 row, 11.34 / 11.39 / 24.40 at 2, 21.81 / 21.56 / 25.18
# at 5, 32.15 / 31.21 / 25.88 at 8. Prefill on tiles of the blocks instead of the dense copy
# (layer 0's 7 matrices, ms): 2.33 vs 1.09 at 9 rows, 2.04 vs 1.51 at 64, 6.09 vs 4.83 at 512: the copy stays.


# With AMX (and the blocks kept), batches multiply tiles decoded from the blocks (``amx_batches``) and no
# dense copy is made: the layer holds the file's bytes only. Measured 2026-12-02 (Xeon with AMX, 1 thread,
# `hearth-llm bench gguf-cpu`, one run, tiles / dense copy, load ~1): the bundled SmolLM2 Q4_1 RSS added by
# the load 224 / 423 MiB (2.39x / 4.51x the file: the rest is the touched KV pool and the runtime), prefill of
# 500 tokens 757 / 1034 tok/s (6.9x / 9.4x llama.cpp), 32 chats 106 / 131 tok/s (6.9x / 8.6x), decode the
# same kernels (25.6 / 25.8 CPU ms/token). Both speeds stay far above the goals (1.5x, 4x): the copy goes.
DENSE_COPY_WITH_AMX = False


def _batches_on_amx(layer, dtype: torch.dtype) -> bool:
    """Whether this layer's batches run on AMX tiles of its kept blocks instead of a dense copy: bf16, every
    shard's type kept in blocks here, AMX granted, each shard's rows in 16s."""
    return (not DENSE_COPY_WITH_AMX and dtype == torch.bfloat16
            and all(_exact_blocks(quant_type, dtype) for quant_type in GGUFInt4LinearMethod.quant_types)
            and all(rows % 16 == 0 for rows in layer.output_sizes_per_rank) and gguf_cpu_native.has_amx())


def amx_batches(runs, bias: torch.Tensor | None, fallback=None):
    """``x -> x @ W.T + bias`` for a weight of block runs ``[(quant_type, data), ...]`` (rows in 16s): bf16
    ``x`` on AMX tiles decoded from each run (``gguf_cpu_native.amx_routine``: the exactly dequantized
    weights in bf16, as a dense copy holds them), each run's columns written in place; other dtypes on
    ``fallback`` (else the runs' exact routine)."""
    routines = [(gguf_cpu_native.amx_routine(data, quant_type), data.shape[0]) for quant_type, data in runs]
    fallback = fallback or gguf_cpu.gguf_linear_routine(runs, bias)
    num_outputs = sum(rows for _, rows in routines)

    def batch(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.numel() == 0:
            return fallback(x)
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if len(routines) == 1:
            out = routines[0][0](flat)
        else:
            out = torch.empty(flat.shape[0], num_outputs, dtype=torch.bfloat16)
            start = 0
            for routine, rows in routines:
                routine(flat, out=out[:, start:start + rows])
                start += rows
        out = out if bias is None else out.add_(bias)
        return out.reshape(*x.shape[:-1], num_outputs)

    return batch


def _tiles_from_codes(layer) -> bool:
    """Whether large batches will decode tiles from the int4 codes (see ``CpuLinear``): only with
    ``DROP_DENSE_COPY``, where the C kernels are built and the rows come in the int4 layout's blocks of 64."""
    return DROP_DENSE_COPY and layer.output_size_per_rank % 64 == 0 and gguf_cpu_native.available()


def _exact_blocks(quant_type: str, dtype: torch.dtype) -> bool:
    """Whether this machine multiplies ``quant_type`` blocks exactly and fast in ``dtype``: the C bf16 Q4
    kernels in bf16, the panel kernels (AVX2) in float32."""
    if dtype == torch.float32:
        return gguf_cpu_native.has_panels(quant_type)
    return gguf_cpu_native.has_bf16(quant_type)


def _has_panels() -> bool:
    return all(gguf_cpu_native.has_panels(quant_type) for quant_type in GGUFInt4LinearMethod.quant_types)


# A float32 step of up to this many rows runs the panel kernels; larger batches tiles decoded from the
# panels (or, FLOAT32_DENSE_COPY on, a dense float32 copy kept beside them, ~6x the file's bytes for Q4).
PANEL_MAX_ROWS = gguf_cpu_native.MAX_ROWS
FLOAT32_DENSE_COPY = False
# Values per decoded tile of a float32 panel layer's batch (4 MiB): small enough to stay in L2/L3 while the
# BLAS reads it. The tile is one scratch per thread, reused (a fresh 4 MiB tensor a call cost more in page
# faults than the decode).
PANEL_TILE_ELEMENTS = 1 << 20
# Batches of up to this many rows run the panel GEMV in passes of PANEL_MAX_ROWS (each row the bits it has
# alone); more decode tiles. AVX2 build, 1 thread, a Q4_1 [3072, 576] panel layer, ms per call, passes /
# tiles: 1.29 / 3.12 at 8 rows, 2.40 / 3.44 at 16, 5.00 / 4.29 at 32, 10.4 / 5.93 at 64.
PANEL_PASS_MAX_ROWS = 24
_tile_scratch = threading.local()


def _scratch(num_values: int) -> torch.Tensor:
    tile = getattr(_tile_scratch, "tile", None)
    if tile is None or tile.numel() < num_values:
        tile = _tile_scratch.tile = torch.empty(num_values, dtype=torch.float32)
    return tile


def panel_tile_linear(runs, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for float32 ``x`` and the panel ``runs`` ``[(quant_type, panels), ...]``, W decoded
    a tile of panels at a time, transposed (``gguf_cpu_native.dequantize_panels_t``: the exact weights), into
    one BLAS call each; memory holds one tile."""
    lead, num_columns = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, num_columns)
    num_outputs = sum(panels.shape[0] * gguf_cpu_native.PANEL_ROWS for _, panels in runs)
    out = torch.empty(flat.shape[0], num_outputs, dtype=x.dtype)
    panels_per_tile = max(1, PANEL_TILE_ELEMENTS // (num_columns * gguf_cpu_native.PANEL_ROWS))
    column = 0
    for quant_type, panels in runs:
        for start in range(0, panels.shape[0], panels_per_tile):
            part = panels[start:start + panels_per_tile]
            tile = gguf_cpu_native.dequantize_panels_t(part, quant_type, out=_scratch(  # [K, n]
                part.shape[0] * gguf_cpu_native.PANEL_ROWS * num_columns))
            end = column + tile.shape[1]
            out[:, column:end] = flat @ tile
            column = end
    if bias is not None:
        out.add_(bias)
    return out.reshape(*lead, num_outputs)


def _panel_routine(runs, weight: torch.Tensor | None, bias: torch.Tensor | None):
    """``x -> x @ W.T + bias`` for a float32 layer: steps of up to :data:`PANEL_MAX_ROWS` rows on the
    panels of ``runs`` (exact block math, each row's bits independent of the batch), more on ``weight``
    where the layer keeps a dense copy, else on tiles of the panels (:func:`panel_tile_linear`)."""
    gemvs = [gguf_cpu_native.panel_gemv_routine(panels, quant_type) for quant_type, panels in runs]
    max_rows = PANEL_MAX_ROWS

    if len(gemvs) == 1:
        gemv = gemvs[0]

        def one_run(x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.dtype == torch.float32 and x.is_contiguous():
                out = gemv(x)
                return out if bias is None else out.add_(bias)
            return runs_or_dense(x)
    else:
        one_run = None

    def runs_or_dense(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if not 0 < flat.shape[0] <= max_rows or x.dtype != torch.float32:
            if weight is not None:
                return F.linear(x, weight, bias)
            if not 0 < flat.shape[0] <= PANEL_PASS_MAX_ROWS or x.dtype != torch.float32:
                return panel_tile_linear(runs, x.float(), bias).to(x.dtype)
            flat = flat.contiguous()
            return torch.cat([runs_or_dense(flat[start:start + max_rows]) for start in range(0, flat.shape[0], max_rows)]
                             ).reshape(*x.shape[:-1], -1)
        flat = flat.contiguous()
        outs = [gemv(flat) for gemv in gemvs]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        out = out if bias is None else out.add_(bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return one_run or runs_or_dense


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


def use_int8_activations(model) -> int:
    """``EngineConfig.cpu_int8_activations``: steps of up to ``gguf_cpu_q8x.MAX_ROWS`` rows (decode,
    speculative verification) of the loaded ``model``'s GGUF layers whose blocks are kept (this method's
    in bf16 engines, its panels in float32 ones, and ``GGUFBlockLinearMethod``'s) and all of the panel kernels'
    types (Q4_0/Q4_1/Q8_0/Q4_K/Q6_K; AVX-512 VNNI or AVX2), and of its block LM head, run the int8-activation kernels
    (``kernels/quant/gguf_cpu_q8x.py``: x quantized per row per block of 32, integer dot products, as
    llama.cpp computes): not the exact bf16 math, each row's bits independent of the step's rows. Larger
    steps (prefill) keep the layer's routine; the kernels' packed copy (``gguf_cpu_q8x.weight_routine``) stays
    beside the blocks, which the other paths read. Returns how many layers (and head) were switched; raises
    ValueError naming the option where none could be (no GGUF blocks kept here, or no kernels built)."""
    from hearth_llm.kernels.quant import gguf_cpu_q8x

    from .cpu_weights import CpuBlockLogitsHead
    from .linear import linear_layers
    from .quant import GGUFBlockLinearMethod

    if not gguf_cpu_q8x.has_panels():
        raise ValueError("cpu_int8_activations=True needs the int8-activation C kernels (AVX-512 VNNI or AVX2), which "
                         "are not built here (no working C compiler, or neither in this CPU or build)")
    switched = 0
    for _, layer in linear_layers(model):
        if getattr(layer, "routine", None) is None:
            continue
        if isinstance(layer.method, GGUFInt4LinearMethod):
            runs = layer.method.block_runs(layer)
            if runs is None and layer.method.panel_runs(layer) is not None:  # float32: the blocks from the panels
                runs = [(quant_type, gguf_cpu_native.unpack_panels(panels, quant_type))
                        for quant_type, panels in layer.method.panel_runs(layer)]
        elif isinstance(layer.method, GGUFBlockLinearMethod) and getattr(layer, "gguf_input_order", None) is None:
            # other GGUF layers' blocks (e.g. a Q8_0 model's), read through the method's own accessor
            runs = [(weight.quant_type, weight.data) for weight in layer.method.block_weights(layer)]
        else:
            continue
        if not runs or not all(gguf_cpu_q8x.supports(quant_type, data.shape[0]) for quant_type, data in runs):
            continue
        layer.routine = _int8_routine(runs, layer.bias, layer.routine)
        switched += 1
    for module in list(model.modules()):
        if isinstance(module, CpuBlockLogitsHead) and module.use_int8_activations():
            switched += 1
    if not switched:
        raise ValueError("cpu_int8_activations=True found no GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q6_K layer kept in its blocks "
                         "(or panels) that the int8 kernels run faster here (Q8_0 does not on AVX2): it needs a GGUF "
                         "model on a CPU engine")
    return switched


def _int8_routine(runs, bias: torch.Tensor | None, fallback):
    """``x -> x @ W.T + bias``: 2-D contiguous bf16 or float32 ``x`` of 1..MAX_ROWS rows on the int8-activation
    kernels (out in x's dtype, as the exact routine's), anything else on ``fallback`` (the layer's routine
    before)."""
    from hearth_llm.kernels.quant import gguf_cpu_q8x

    max_rows = gguf_cpu_q8x.MAX_ROWS
    gemvs, step_runs = {torch.bfloat16: [], torch.float32: []}, []
    for quant_type, data in runs:
        if gguf_cpu_q8x.has_panels() and data.shape[0] % gguf_cpu_q8x.PANEL_ROWS == 0 \
                and quant_type in gguf_cpu_q8x.PANEL_TYPES:
            panels = gguf_cpu_q8x.pack(data, quant_type)
            for dtype, out in gemvs.items():
                out.append(gguf_cpu_q8x.panel_gemv_routine(panels, quant_type, bf16_out=dtype == torch.bfloat16))
            step_runs.append(StepRun(quant_type, panels, int8=True))
        else:
            for dtype, out in gemvs.items():
                out.append(gguf_cpu_q8x.gemv_routine(data, quant_type, bf16_out=dtype == torch.bfloat16))
            step_runs = None

    def int8_or_fallback(x: torch.Tensor) -> torch.Tensor:
        kernels = gemvs.get(x.dtype)
        if kernels is not None and x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.is_contiguous():
            out = kernels[0](x) if len(kernels) == 1 else torch.cat([gemv(x) for gemv in kernels], dim=-1)
            return out if bias is None else out.add_(bias)
        return fallback(x)

    # what a CPU step's one C call runs instead (cpu_step): the same kernel on the same panels
    int8_or_fallback.step_runs = step_runs or None
    return int8_or_fallback
