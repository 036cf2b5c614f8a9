"""How a linear layer holds its weight and multiplies: the pluggable half of :mod:`.linear`.

A method is stateless and shared; what it creates lives on the layer. Its four steps:

* ``create_weights(layer)``: register the tensors checkpoint weights load into, with
  ``layer.register_loadable(name, empty_tensor)`` (sizes from ``layer.output_size_per_rank`` and
  ``layer.input_size_per_rank``; row 0 is always an output row, so a shard is a row range).
* ``load_weight(layer, name, param, loaded, offset)``: put one shard's rows for this rank
  (``loaded``, already cut to this rank) at row ``offset`` of ``param``. ``loaded`` is a tensor, or
  a quantized tensor from the loader (e.g. GGUF blocks) that has ``dequantized(dtype)``.
* ``process_weights_after_loading(layer)``: repack once everything is in (oneDNN layout, int4
  packing, FP8 scales...).
* ``apply(layer, x, bias)``: ``x @ W.T + bias``.
* ``forward_routine(layer)`` (optional): after loading, ``x -> layer(x)`` with the kernel chosen
  and the tensors bound, which the layer then calls instead of ``apply``: one Python call per
  matmul in a decode step. None (the default) keeps ``apply``.

A quantized method (next to this file, e.g. ``gguf_linear_method.py``) subclasses
:class:`LinearMethod`; the model runner picks one per layer before loading (see
``engine/loader/model_loader.py``), so model code never changes.

>>> class Fp32Method(DenseLinearMethod):
...     def apply(self, layer, x, bias):
...         return super().apply(layer, x.float(), bias).to(x.dtype)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hearth_llm.kernels import cpu_ops

from .cpu_weights import CpuLinear


def dense_value(loaded, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint value as a plain tensor: quantized ones (with ``dequantized``) dequantized."""
    dequantized = getattr(loaded, "dequantized", None)
    return dequantized(dtype) if dequantized is not None else loaded


class LinearMethod:
    """The interface; see the module docstring."""

    def create_weights(self, layer) -> None:
        raise NotImplementedError

    def checkpoint_shape(self, layer, name: str, num_rows: int) -> tuple[int, ...]:
        """The shape the checkpoint stores tensor ``name`` of a shard of ``num_rows`` rows in."""
        return (num_rows, layer.input_size)

    def narrow_input(self, loaded, start: int, size: int):
        """Cut input columns ``start:start+size`` (row-parallel layers); quantized formats cut whole blocks."""
        return loaded.narrow(1, start, size)

    def load_weight(self, layer, name: str, param, loaded, offset: int) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer) -> None:
        pass

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def forward_routine(self, layer):
        """``x -> apply(layer, x, layer.bias)`` fixed once the weights are in, or None. The layer
        drops it when its method is replaced (a LoRA wrapper) or its tensors move."""
        return None

    def cpu_step_runs(self, layer, dtype: torch.dtype) -> list | None:
        """The layer's output rows as :class:`~hearth_llm.kernels.cpu_step_native.StepRun` s where its
        routine multiplies a CPU step of ``dtype`` (float32 or bf16) and up to ``gguf_cpu_native.MAX_ROWS``
        rows by the GGUF C GEMVs, one per run into its columns, then adds the bias (what ``cpu_step``
        then runs in one native call for all layers, once it checked the layer's routine is still this
        method's); else None.

        >>> layer.method.cpu_step_runs(layer, torch.bfloat16)   # [StepRun("Q4_K", blocks), ...] or None
        """
        return None


class DenseLinearMethod(LinearMethod):
    """A plain weight in the compute dtype.

    On the CPU a bf16 weight is then kept in oneDNN's blocked layout (``layer.cpu_weight``, a
    :class:`CpuLinear`) and the plain copy dropped: ``F.linear`` would reorder it on every call.
    The weight's values are not searched for a 4-bit grid: a 4-bit method is chosen before
    loading, from the checkpoint's tensor types (``GGUFInt4LinearMethod`` for Q4_0/Q4_1 GGUF).
    """

    def create_weights(self, layer) -> None:
        layer.register_loadable("weight", torch.empty(layer.output_size_per_rank, layer.input_size_per_rank))

    def load_weight(self, layer, name, param, loaded, offset) -> None:
        param.data.narrow(0, offset, loaded.shape[0]).copy_(dense_value(loaded, param.dtype))

    def process_weights_after_loading(self, layer) -> None:
        weight = layer.weight
        if weight.device.type != "cpu":
            return
        packed = cpu_ops.pack_dense_weight(weight)
        if packed is None:
            return
        layer.cpu_weight = CpuLinear(packed, None)
        del layer.weight

    def apply(self, layer, x, bias):
        cpu_weight = getattr(layer, "cpu_weight", None)
        if cpu_weight is not None:
            return cpu_weight(x, bias)
        return F.linear(x, layer.weight, bias)

    def forward_routine(self, layer):
        cpu_weight = getattr(layer, "cpu_weight", None)
        return None if cpu_weight is None else cpu_weight.routine(layer.bias)


DENSE = DenseLinearMethod()
