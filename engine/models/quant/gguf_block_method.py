"""GGUF weights kept in llama.cpp's block formats: a linear method chosen from the tensor types.

A layer's checkpoint shards (q/k/v, gate/up, or one) each arrive as :class:`GGUFBlocks` of one
type; Q4_K_M files mix types inside one fused layer (v in Q6_K next to q/k in Q4_K), so the layer
holds one uint8 buffer per run of consecutive shards of the same type (``gguf_blocks_0``, ...):
the file's bytes, nothing else. ``apply`` multiplies each run through ``kernels.linear`` with a
:class:`GGUFBlockWeight` (Triton on CUDA; on the CPU the C GEMV for decode steps and a tiled
dequantize-and-multiply for batches, ``kernels/quant/gguf_cpu.py``) and joins the outputs.

>>> method = GGUFBlockLinearMethod({"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"})
>>> configure_linears(model, lambda name, layer: method if name.endswith("qkv_proj") else None)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth_llm.engine.loader.gguf_blocks import GGUFBlocks
from hearth_llm.kernels import linear
from hearth_llm.kernels.quant import BLOCK_FORMATS, GGUFBlockWeight, block_format, gguf_cpu, gguf_cpu_native

from ..gguf_linear_method import amx_batches
from ..linear_method import LinearMethod


@dataclass(frozen=True, slots=True)
class _Run:
    """Rows ``start:start + num_rows`` of this rank's weight, all of ``quant_type``, in buffer ``name``."""

    name: str
    quant_type: str
    start: int
    num_rows: int


class GGUFBlockLinearMethod(LinearMethod):
    """See the module docstring. ``shard_types`` maps each shard id of the layer (``None`` for a
    checkpoint that stores a fused layer whole) to its GGUF type, as the file's tensor types say."""

    quant_types = tuple(BLOCK_FORMATS)

    def __init__(self, shard_types: dict) -> None:
        for shard, quant_type in shard_types.items():
            block_format(quant_type)  # ValueError naming the supported types
        self.shard_types = dict(shard_types)

    def _runs(self, layer) -> list[_Run]:
        runs: list[_Run] = []
        for shard, num_rows in zip(layer.shard_ids, layer.output_sizes_per_rank):
            quant_type = self.shard_types.get(shard, self.shard_types.get(None))
            start = layer.shard_rows(shard)[0]
            if runs and runs[-1].quant_type == quant_type and runs[-1].start + runs[-1].num_rows == start:
                last = runs.pop()
                runs.append(_Run(last.name, quant_type, last.start, last.num_rows + num_rows))
            else:
                runs.append(_Run(f"gguf_blocks_{len(runs)}", quant_type, start, num_rows))
        return runs

    def create_weights(self, layer) -> None:
        columns = layer.input_size_per_rank
        for run in self._runs(layer):
            fmt = block_format(run.quant_type)
            if columns % fmt.block_size:
                raise ValueError(f"{layer.prefix}: {columns} input columns are not whole {run.quant_type} blocks of "
                                 f"{fmt.block_size}")
            layer.register_buffer(run.name, torch.empty(run.num_rows, fmt.row_bytes(columns), dtype=torch.uint8))
        # What checkpoint tensors load through (its shape check, its weight_loader); holds no data.
        layer.register_loadable("weight", torch.empty(0))

    def load_weight(self, layer, name, param, loaded, offset) -> None:
        run = next(r for r in self._runs(layer) if r.start <= offset < r.start + r.num_rows)
        if not isinstance(loaded, GGUFBlocks) or loaded.quant_type != run.quant_type:
            got = loaded.quant_type if isinstance(loaded, GGUFBlocks) else type(loaded).__name__
            raise ValueError(f"{layer.prefix} rows {offset}.. were set up for GGUF {run.quant_type} blocks (from the "
                             f"file's tensor types), got {got}")
        getattr(layer, run.name).narrow(0, offset - run.start, loaded.shape[0]).copy_(loaded.data)
        self._load_input_order(layer, loaded)

    @staticmethod
    def _load_input_order(layer, loaded: GGUFBlocks) -> None:
        """GPTQ act-order: every shard of a layer must hold its columns in one order (q/k/v and
        gate/up see the same input, and GPTQ orders by that input's statistics)."""
        order = None if loaded.input_order is None else loaded.input_order.to(torch.int64)
        seen = getattr(layer, "_input_orders_seen", 0)
        layer._input_orders_seen = seen + 1
        current = getattr(layer, "gguf_input_order", None)
        if seen == 0:
            if order is not None:
                layer.register_buffer("gguf_input_order", order.to(getattr(layer, "gguf_blocks_0").device))
            return
        if (current is None) != (order is None) or (order is not None and not torch.equal(current.cpu(), order.cpu())):
            raise ValueError(f"{layer.prefix}: its shards hold their input columns in different orders (GPTQ act-order "
                             "g_idx); a fused layer needs one order for all of them")

    def process_weights_after_loading(self, layer) -> None:
        layer._parameters.pop("weight", None)  # the empty loading handle
        layer.__dict__.pop("_input_orders_seen", None)
        layer.gguf_runs = tuple(self._runs(layer))

    def block_weights(self, layer) -> list[GGUFBlockWeight]:
        """The layer's runs as kernel weight formats, in output-row order (made per call from the
        buffers, so a model moved between devices keeps working)."""
        runs = getattr(layer, "gguf_runs", None) or self._runs(layer)
        return [GGUFBlockWeight(run.quant_type, getattr(layer, run.name)) for run in runs]

    def apply(self, layer, x, bias):
        flat = x.reshape(-1, x.shape[-1])
        order = getattr(layer, "gguf_input_order", None)
        if order is not None:  # act-order blocks: feed the columns in the order they were stored
            flat = flat.index_select(-1, order)
        weights = self.block_weights(layer)
        if len(weights) == 1:
            out = linear(flat, weights[0], bias)
        else:
            out = torch.cat([linear(flat, weight, None) for weight in weights], dim=-1)
            if bias is not None:
                out = out.add_(bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def cpu_step_runs(self, layer, dtype):
        weights = self.block_weights(layer)
        if getattr(layer, "gguf_input_order", None) is not None or weights[0].data.device.type != "cpu":
            return None
        return gguf_cpu.step_runs([(weight.quant_type, weight.data) for weight in weights], dtype)

    def forward_routine(self, layer):
        """On the CPU, the C GEMV bound to the layer's runs for decode steps (``gguf_cpu``) and, where AMX
        runs, bf16 batches on AMX tiles decoded from the runs (``amx_batches``: the exactly dequantized
        weights, as the tiled path multiplies them); None elsewhere, with act-order blocks, or where the
        C kernels are not built."""
        weights = self.block_weights(layer)
        if getattr(layer, "gguf_input_order", None) is not None or weights[0].data.device.type != "cpu":
            return None
        runs = [(weight.quant_type, weight.data) for weight in weights]
        exact = gguf_cpu.gguf_linear_routine(runs, layer.bias)
        if exact is None or not _batches_on_amx(runs):
            return exact
        batches, max_rows = amx_batches(runs, layer.bias, exact), gguf_cpu_native.MAX_ROWS

        def exact_or_amx(x: torch.Tensor) -> torch.Tensor:
            return exact(x) if x.numel() <= max_rows * x.shape[-1] else batches(x)

        return exact_or_amx

    def resident_bytes(self, layer) -> int:
        """Bytes this layer's weight occupies (its block buffers, and an act-order permutation)."""
        order = getattr(layer, "gguf_input_order", None)
        extra = 0 if order is None else order.numel() * order.element_size()
        return sum(weight.data.numel() for weight in self.block_weights(layer)) + extra


def _batches_on_amx(runs) -> bool:
    """Whether batches of these CPU runs can run on AMX tiles (``gguf_cpu_native.has_amx``; rows in 16s).
    Against ``gguf_cpu``'s tiles through torch (the same products), measured 2026-12-02 (Xeon with AMX, 1
    thread, `hearth-llm bench gguf-cpu`, AMX / torch tiles): 1B Q4_K_M prefill 157 / 183 tok/s, 32 chats
    27.7 / 24.9 tok/s; 1B Q8_0 186 / 198 and 29.6 / 18.9. Prefill 6-14% slower, 32 chats 1.1-1.6x faster,
    no memory either way: AMX it is."""
    return all(data.shape[0] % 16 == 0 for _, data in runs) and gguf_cpu_native.has_amx()
