"""Linear layers that know how to load their checkpoint slices, and delegate their math to a
:class:`~.linear_method.LinearMethod`.

Five layers cover every projection of a decoder model:

* :class:`ReplicatedLinear`: the whole weight on every rank (routers, small heads).
* :class:`ColumnLinear`: output rows split across tensor-parallel ranks.
* :class:`RowLinear`: input columns split across ranks; partial sums all-reduced (o_proj, down_proj).
* :class:`MergedColumnLinear`: several column linears stored as one weight, shards ``0..n-1``
  (gate/up).
* :class:`QKVLinear`: query, key and value projections in one weight, shards ``"q"``, ``"k"``,
  ``"v"``; key/value heads replicated when there are fewer of them than ranks.

Every loadable parameter carries ``param.weight_loader(param, loaded_weight, shard_id=None)``,
which puts a checkpoint tensor (the full, unsharded tensor of one shard) into this rank's slice,
and ``param.checkpoint_shape(shard_id)``, the shape that tensor must have (checked before any
weight is read). Which tensors a layer holds and how it multiplies is its method's business:
dense today; quantized (GGUF blocks, FP8, AWQ) and tensor-parallel variants are other methods or
other :class:`TensorParallel` settings, chosen by :func:`configure_linears` before loading.

>>> qkv = QKVLinear(hidden_size=64, head_dim=16, num_heads=4, num_kv_heads=2, bias=False)
>>> qkv.weight.shape
torch.Size([128, 64])
>>> qkv.weight.weight_loader(qkv.weight, torch.ones(32, 64), "k")   # rows 64..95
>>> qkv(torch.randn(3, 64)).shape
torch.Size([3, 128])
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .linear_method import DENSE, LinearMethod, dense_value


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """Which slice of the model this process holds: rank ``rank`` of ``size``; ``all_reduce`` sums
    a tensor over the ranks in place (None for a single process)."""

    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], None] | None = None


SINGLE_PROCESS = TensorParallel()


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` over ``output_sizes`` shards of output rows.

    Subclasses say how a shard id maps to rows (:meth:`shard_rows`) and how tensor parallelism
    splits the layer (:meth:`rank_rows`, :attr:`splits_input`). The method creates the weight
    tensors; the layer itself owns the bias, which is always dense. Once loaded, :attr:`routine`
    may hold the method's bound kernel (``LinearMethod.forward_routine``), which ``forward`` calls
    directly; it is None before loading and after the method or the tensors change.
    """

    splits_input = False  # RowLinear: each rank holds a slice of the input columns

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, prefix: str = "") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.has_bias = bias
        self.prefix = prefix
        self.parallel = SINGLE_PROCESS
        self.method = DENSE
        self._method_tensors: list[str] = []
        self._create()

    @property
    def method(self) -> LinearMethod:
        return self._method

    @method.setter
    def method(self, method: LinearMethod) -> None:
        # A new method (e.g. a LoRA wrapper after loading) multiplies its own way: forget the
        # routine the old one bound.
        self._method = method
        self.routine = None

    # --- configuration before loading --------------------------------------------------------

    def configure(self, method: LinearMethod | None = None, parallel: TensorParallel | None = None) -> None:
        """Swap the method and/or the tensor-parallel slice; must happen before loading (the
        tensors are re-created empty, on the device of the current ones)."""
        self.method = method or self.method
        self.parallel = parallel or self.parallel
        self._create()

    def _create(self) -> None:
        for name in self._method_tensors + ["bias"]:
            self._parameters.pop(name, None)
            self._buffers.pop(name, None)
        self._method_tensors = []
        device = next((t.device for t in self.method_tensors()), None)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            before = set(self._parameters) | set(self._buffers)
            self.method.create_weights(self)
            self._method_tensors = [n for n in list(self._parameters) + list(self._buffers) if n not in before]
            if self.has_bias:
                self.register_loadable("bias", torch.empty(self.output_size_per_rank))
            else:
                self.bias = None

    def method_tensors(self) -> list[torch.Tensor]:
        return [t for n, t in list(self._parameters.items()) + list(self._buffers.items()) if t is not None]

    # --- sizes on this rank -------------------------------------------------------------------

    @property
    def input_size_per_rank(self) -> int:
        return self.input_size // self.parallel.size if self.splits_input else self.input_size

    @property
    def output_sizes_per_rank(self) -> list[int]:
        return [self.rank_rows(shard)[1] for shard in self.shard_ids]

    @property
    def output_size_per_rank(self) -> int:
        return sum(self.output_sizes_per_rank)

    @property
    def shard_ids(self) -> list:
        return [None]

    def shard_rows(self, shard_id) -> tuple[int, int]:
        """``(first row, number of rows)`` of a shard in this rank's weight."""
        self._check_shard_id(shard_id)
        return 0, self.output_size_per_rank

    def rank_rows(self, shard_id) -> tuple[int, int]:
        """``(first row, number of rows)`` of this rank's part of a shard in the checkpoint tensor."""
        size = self.output_sizes[self.shard_ids.index(shard_id)]
        return 0, size

    def checkpoint_rows(self, shard_id) -> int:
        """Rows of a shard in the checkpoint; ``None`` on a fused layer: all of them."""
        if shard_id is None:
            return self.output_size
        self._check_shard_id(shard_id)
        return self.output_sizes[self.shard_ids.index(shard_id)]

    def _check_shard_id(self, shard_id) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(f"{type(self).__name__} {self.prefix!r}: shard id {shard_id!r} is not one of "
                             f"{self.shard_ids}")

    # --- loading ------------------------------------------------------------------------------

    def register_loadable(self, name: str, tensor: torch.Tensor) -> nn.Parameter:
        """Register ``tensor`` as a frozen parameter that checkpoint tensors load into through
        :meth:`weight_loader`; methods call this from ``create_weights``."""
        param = nn.Parameter(tensor, requires_grad=False)
        self.register_parameter(name, param)
        self._attach_loaders()
        return param

    def _attach_loaders(self) -> None:
        for name, param in self._parameters.items():
            if param is not None:
                param.weight_loader = self.weight_loader
                param.checkpoint_shape = lambda shard_id=None, _name=name: self.checkpoint_shape(_name, shard_id)

    def _apply(self, fn, recurse=True):
        # Moving between devices (to_empty from meta) makes new Parameter objects: re-attach, and
        # drop a routine bound to the old tensors.
        module = super()._apply(fn, recurse)
        self._attach_loaders()
        self.routine = None
        return module

    def checkpoint_shape(self, name: str, shard_id=None) -> tuple[int, ...]:
        rows = self.checkpoint_rows(shard_id)
        if name == "bias":
            return (rows,)
        return self.method.checkpoint_shape(self, name, rows)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        """Put ``loaded_weight`` (one shard of the checkpoint, unsharded) into this rank's rows.

        ``shard_id=None`` on a fused layer loads a checkpoint that stores it fused too (Phi-3's
        ``qkv_proj``, ``gate_up_proj``): the tensor is split into its shards here.
        """
        name = next(n for n, p in self._parameters.items() if p is param)
        if shard_id is None and self.shard_ids != [None]:
            expected = self.checkpoint_shape(name, None)
            if tuple(loaded_weight.shape) != tuple(expected):
                raise ValueError(f"weight {self.prefix}.{name} has shape {tuple(loaded_weight.shape)}, the config "
                                 f"makes it {tuple(expected)}")
            start = 0
            for shard, size in zip(self.shard_ids, self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, start, size), shard)
                start += size
            return
        expected = self.checkpoint_shape(name, shard_id)
        if tuple(loaded_weight.shape) != tuple(expected):
            raise ValueError(f"weight {self.prefix}.{name} (shard {shard_id!r}) has shape "
                             f"{tuple(loaded_weight.shape)}, the config makes it {tuple(expected)}")
        first_row, num_rows = self.rank_rows(shard_id)
        loaded_weight = loaded_weight.narrow(0, first_row, num_rows)
        if self.splits_input and name != "bias":
            columns = self.input_size_per_rank
            loaded_weight = self.method.narrow_input(loaded_weight, self.parallel.rank * columns, columns)
        offset, _ = self.shard_rows(shard_id)
        if name == "bias":
            if self.splits_input and self.parallel.rank != 0:
                param.data.zero_()  # in rank 0's partial sum only: the all-reduce adds it once
            else:
                param.data.narrow(0, offset, num_rows).copy_(dense_value(loaded_weight, param.dtype))
            return
        self.method.load_weight(self, name, param, loaded_weight, offset)

    def process_weights_after_loading(self) -> None:
        """The method repacks the loaded weights, and may bind them into :attr:`routine`."""
        self.method.process_weights_after_loading(self)
        self.routine = self.method.forward_routine(self) if self.parallel.size == 1 else None
        # cpu_step checks it: a routine swapped in later (cpu_int8_activations') is not the method's
        self.method_routine = self.routine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routine = self.routine  # a decode step's hot path: one call, no dispatch
        if routine is not None:
            return routine(x)
        return self.method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, bias={self.has_bias}, "
                f"method={type(self.method).__name__}")


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank.

    >>> ReplicatedLinear(8, 4, bias=True)(torch.randn(2, 8)).shape
    torch.Size([2, 4])
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = "") -> None:
        super().__init__(input_size, [output_size], bias, prefix)


class ColumnLinear(LinearBase):
    """Output rows split evenly across tensor-parallel ranks (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = "") -> None:
        super().__init__(input_size, [output_size], bias, prefix)

    def rank_rows(self, shard_id) -> tuple[int, int]:
        size = self.output_sizes[self.shard_ids.index(shard_id)] // self.parallel.size
        return self.parallel.rank * size, size


class MergedColumnLinear(ColumnLinear):
    """Several column linears of the same input in one weight (gate and up: shards 0 and 1).

    >>> gate_up = MergedColumnLinear(64, [128, 128])
    >>> gate_up.weight.weight_loader(gate_up.weight, torch.zeros(128, 64), 1)   # rows 128..255
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, prefix: str = "") -> None:
        LinearBase.__init__(self, input_size, output_sizes, bias, prefix)

    @property
    def shard_ids(self) -> list:
        return list(range(len(self.output_sizes)))

    def shard_rows(self, shard_id) -> tuple[int, int]:
        self._check_shard_id(shard_id)
        sizes = self.output_sizes_per_rank
        return sum(sizes[:shard_id]), sizes[shard_id]


class QKVLinear(ColumnLinear):
    """Query, key and value projections in one weight: shards ``"q"``, ``"k"``, ``"v"``.

    Query heads are split across ranks; key/value heads too, or replicated (each rank keeps the
    one head its query heads use) when there are fewer of them than ranks. The attention layer
    reads :attr:`num_heads_per_rank` and :attr:`num_kv_heads_per_rank`.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 prefix: str = "") -> None:
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        LinearBase.__init__(self, hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                                num_kv_heads * head_dim], bias, prefix)

    @property
    def shard_ids(self) -> list:
        return ["q", "k", "v"]

    def _create(self) -> None:
        # Plain attributes, not properties: the attention layer reads them on every step.
        self.num_heads_per_rank = self.num_heads // self.parallel.size
        self.num_kv_heads_per_rank = max(1, self.num_kv_heads // self.parallel.size)
        super()._create()

    def rank_rows(self, shard_id) -> tuple[int, int]:
        rank, size = self.parallel.rank, self.parallel.size
        if shard_id == "q":
            return rank * self.num_heads_per_rank * self.head_dim, self.num_heads_per_rank * self.head_dim
        if self.num_kv_heads >= size:
            first_head = rank * self.num_kv_heads_per_rank
        else:  # replicated: ranks that share a KV head hold the same copy
            first_head = rank * self.num_kv_heads // size
        return first_head * self.head_dim, self.num_kv_heads_per_rank * self.head_dim

    def shard_rows(self, shard_id) -> tuple[int, int]:
        self._check_shard_id(shard_id)
        q_rows, kv_rows = self.num_heads_per_rank * self.head_dim, self.num_kv_heads_per_rank * self.head_dim
        return {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}[shard_id]


class RowLinear(LinearBase):
    """Input columns split across ranks; each rank's partial product (the bias in rank 0's only)
    is summed by an all-reduce. ``reduce_results = False`` leaves the partial sum to the caller's
    own all-reduce: an MoE block reduces its shared expert with its routed experts in one."""

    splits_input = True
    reduce_results = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = "") -> None:
        super().__init__(input_size, [output_size], bias, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routine = self.routine  # bound only in a single process
        if routine is not None:
            return routine(x)
        # Ranks other than 0 hold a zero bias: each partial sum carries it from rank 0 only, before the
        # all-reduce (adding it after, on every rank, would give ranks other than 0 no bias at all).
        out = self.method.apply(self, x, self.bias)
        if self.parallel.size > 1 and self.reduce_results:  # else the caller's all-reduce sums the ranks
            self.parallel.all_reduce(out)
        return out


def linear_layers(model: nn.Module) -> list[tuple[str, LinearBase]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, LinearBase)]


def configure_linears(model: nn.Module, choose_method: Callable[[str, LinearBase], LinearMethod | None] | None = None,
                      parallel: TensorParallel | None = None) -> None:
    """Give every linear layer of ``model`` its method (``choose_method(name, layer)``; None keeps
    the current one) and tensor-parallel slice. Call on the freshly built model, before loading.

    >>> configure_linears(model, lambda name, layer: Int4Method() if name.endswith("mlp.down_proj") else None)
    """
    for name, layer in linear_layers(model):
        if parallel is not None:  # first: a method's supports(layer) judges this rank's sizes
            layer.configure(parallel=parallel)
        method = choose_method(name, layer) if choose_method is not None else None
        if method is not None:
            layer.configure(method)
