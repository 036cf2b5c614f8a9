"""A linear method that adds batched LoRA updates on top of any other method (dense, GGUF, FP8...).

:func:`wrap_with_lora` puts a :class:`LoRALinearMethod` around each linear layer's current
method after the model has loaded: the base weights and their packing are untouched, the base
method still computes ``x @ W.T + b``, and the wrapper adds each token's adapter update from the
layer's slot tensors (``lora_a`` ``[S, blocks * max_rank, in]``, ``lora_b`` ``[S, blocks *
max_rank, out]``; one rank block per shard, so q, k and v of a fused ``qkv_proj`` each keep their
own A and B). Which slot each token uses is the step's :class:`LoRAStep`, which the model
runner fills before every forward pass: an explicit object handed to every wrapper at wrap time,
since the model's forward signature carries no adapter inputs. A step without adapters runs the
base methods alone; a step with some plans its tokens once and every layer-projection adds its
update in one shrink and one expand launch (``kernels/lora``).

>>> step = LoRAStep(capacity=2048, device=torch.device("cpu"))
>>> wrapped = wrap_with_lora(model, num_slots=8, max_rank=16, step=step)
>>> sorted(wrapped)[:2]
['layers.0.mlp.down_proj', 'layers.0.mlp.gate_up_proj']
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from hearth_llm import kernels
from hearth_llm.kernels.lazy_triton import triton_module
from hearth_llm.kernels.lora import (LoRAPlan, add_lora, add_lora_planned, expand_planned, expand_silu_and_mul_planned,
                                     scratch_numel, shrink_planned)

from . import fused_decode
from .linear import linear_layers
from .linear_method import DENSE, DenseLinearMethod, LinearMethod
from .mlp import GatedMLP
from .tp_lora import rank_shards


class LoRAStep:
    """The current forward pass's adapter inputs, shared by every wrapped layer; set once per step.

    ``has_adapters`` (a host bool) says whether any token of the step has an adapter: when it is
    False every wrapped layer is exactly its base method, with no kernel launched. On CUDA the
    step's :class:`~hearth_llm.kernels.lora.LoRAPlan` (fixed device buffers, so CUDA graphs
    captured under :meth:`capturing` read each replay's plan) and one float32 scratch shared by all
    layers. On the CPU the step keeps a compact form instead: only the slots this step uses (a
    slice when they are consecutive) and the tokens' indices into them, so the reference kernel's
    cost grows with the adapters in the batch, not with ``max_loras``.
    """

    # CUDA: the shrink on a side stream beside the base projection. Off by default: the engine path with it
    # has not passed a GPU test yet (its H200 engine tests ran past their time slot); benchmarks/lora.py can turn it on.
    overlaps_shrink = False
    # CUDA, plain dense layers: every slot's A stacked under the base weight, so the base GEMM computes the shrink too
    # and a LoRA step adds one expand launch per projection (see LoRALinearMethod.stack_a_under_weight).
    stacks_shrink = True
    # With the shrink stacked: a gated MLP's SwiGLU adds its gate_up_proj's update (LoRASiluAndMul), no in-place expand.
    defers_gate_up_expand = True
    # Layers (by the end of their name, e.g. "o_proj") that keep the separate shrink even where stacking applies.
    unstacked_layers: tuple[str, ...] = ()

    def __init__(self, capacity: int, device: torch.device, planned: bool | None = None) -> None:
        self.capacity = capacity
        self.device = device
        self.is_planned = device.type == "cuda" if planned is None else planned  # (tests plan on the CPU)
        self.has_adapters = False
        self.is_capturing = False
        self.num_tokens = 0
        self.plan: LoRAPlan | None = None
        self.scratch: torch.Tensor | None = None
        self.used_slots: slice | torch.Tensor = slice(0, 0)
        self.compact_token_slots = torch.full((0,), -1, dtype=torch.long)
        self.is_single_adapter = False
        self.side_stream = None  # CUDA: where the shrink runs beside the base projection
        self.deferring_methods: list["LoRALinearMethod"] = []  # gate_up_projs whose SwiGLU adds their update

    def allocate(self, num_slots: int, max_ranks_per_layer: int) -> None:
        """The device plan and scratch (CUDA), once, before any graph is captured."""
        if not self.is_planned:
            return
        self.plan = LoRAPlan(self.capacity, num_slots, self.device)
        self.scratch = torch.zeros(scratch_numel(self.capacity, max_ranks_per_layer), dtype=torch.float32,
                                   device=self.device)
        if self.device.type == "cuda":
            self.side_stream = torch.cuda.Stream(device=self.device)

    def begin_sequences(self, slot_of_seq, num_tokens_of_seq) -> None:
        """Set this step: sequence ``i`` has ``num_tokens_of_seq[i]`` tokens on slot ``slot_of_seq[i]``
        (``-1``: the base model). Host work only, plus one transfer on CUDA."""
        self._drop_pending_expands()
        if self.plan is not None:
            self.plan.set_sequences(slot_of_seq, num_tokens_of_seq)
            self.num_tokens, self.has_adapters = self.plan.num_tokens, self.plan.has_adapters
            return
        self.begin(torch.from_numpy(np.repeat(np.asarray(slot_of_seq, dtype=np.int64),
                                              np.asarray(num_tokens_of_seq, dtype=np.int64))))

    def begin(self, token_slots: list[int] | torch.Tensor) -> None:
        """Set this step's slot per token (``-1`` for base-model tokens)."""
        self._drop_pending_expands()
        slots = torch.as_tensor(token_slots, dtype=torch.long).cpu()
        if len(slots) > self.capacity:
            raise RuntimeError(f"a step of {len(slots)} tokens exceeds the LoRA step's capacity ({self.capacity})")
        if self.plan is not None:
            self.plan.set_token_slots(slots)
        self.num_tokens = len(slots)
        self.has_adapters = bool((slots >= 0).any())
        if self.plan is None and self.has_adapters:
            self._compact(slots)

    def end(self) -> None:
        """After the forward pass: a forward the runner did not prepare (a pooling pass, a graph
        warm-up) runs the base model."""
        self.has_adapters = False
        self._drop_pending_expands()

    def _drop_pending_expands(self) -> None:
        # (left by a forward that raised between a gate_up_proj and its SwiGLU)
        for method in self.deferring_methods:
            method.pending_expand = None

    @contextlib.contextmanager
    def capturing(self):
        """CUDA graphs captured inside hold the LoRA kernels (each replay reads the plan that
        :meth:`begin_sequences` set); outside, layers record nothing but the base model."""
        if self.plan is None:
            raise RuntimeError("LoRAStep.capturing needs the CUDA plan (allocate on a CUDA device)")
        self.plan.clear()  # stale tiles could name tokens beyond the captured batch
        self._drop_pending_expands()
        self.has_adapters, self.is_capturing = True, True
        try:
            yield
        finally:
            self.has_adapters, self.is_capturing = False, False

    def covers(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is this step's (planned) forward: the runner's tokens, or a graph being captured."""
        return self.plan is not None and (x.shape[0] == self.num_tokens or self.is_capturing)

    def can_overlap(self, x: torch.Tensor) -> bool:
        """Whether this forward's layers run their shrink on the side stream (CUDA, the runner's pass)."""
        return (self.side_stream is not None and self.overlaps_shrink and x.is_cuda
                and (x.shape[0] == self.num_tokens or self.is_capturing))

    def apply_overlapped(self, layer, x: torch.Tensor, bias, method: "LoRALinearMethod") -> torch.Tensor:
        """``base.apply`` plus the update, the shrink on the side stream beside the base projection (it
        reads only ``x``; both are tiny beside a decode step's weight reads), the expand after both.
        The side stream forks from and joins the current one, so graph capture records both branches."""
        main = torch.cuda.current_stream(x.device)
        self.side_stream.wait_stream(main)
        with torch.cuda.stream(self.side_stream):
            shrunk = shrink_planned(x, self.plan, method.lora_a, self.scratch)
        y = method.base.apply(layer, x, bias)
        main.wait_stream(self.side_stream)
        return expand_planned(y, shrunk, self.plan, method.lora_b, method.slice_starts, method.max_rank)

    def add(self, y: torch.Tensor, x: torch.Tensor, method: "LoRALinearMethod") -> None:
        """``y += `` each token's adapter update through ``method``'s slot tensors."""
        if self.plan is not None:
            if x.shape[0] == self.num_tokens or self.is_capturing:
                add_lora_planned(y, x, self.plan, method.lora_a, method.lora_b, method.slice_starts,
                                 method.max_rank, self.scratch)
            return
        if x.shape[0] != self.num_tokens:  # not the runner's forward: the base model
            return
        used = self.used_slots
        x = x.to(method.lora_a.dtype)  # float32 slots on the CPU: small bf16 matmuls are slow there
        if self.is_single_adapter:  # every token on one adapter (a batch-1 decode): two plain matmuls
            y += (x @ method.lora_a[used][0].T) @ method.lora_b[used][0]
            return
        add_lora(y, x, self.compact_token_slots, method.lora_a[used], method.lora_b[used])

    def _compact(self, slots: torch.Tensor) -> None:
        used = torch.unique(slots[slots >= 0])
        first, last = int(used[0]), int(used[-1])
        is_range = last - first + 1 == len(used)
        self.used_slots = slice(first, last + 1) if is_range else used
        position = torch.full((last + 1,), -1, dtype=torch.long)
        position[used] = torch.arange(len(used))
        self.compact_token_slots = torch.where(slots >= 0, position[slots.clamp(min=0)], -1)
        self.is_single_adapter = len(used) == 1 and bool((slots >= 0).all())


class LoRALinearMethod(LinearMethod):
    """``base.apply(...)`` plus each token's adapter update; loading steps delegate to ``base``."""

    def __init__(self, base: LinearMethod, layer, num_slots: int, max_rank: int, step: LoRAStep,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.base = base
        self.step = step
        self.max_rank = max_rank
        self._stacked_layer = None  # the layer whose weight has every slot's A stacked under it (see below)
        # A gated MLP's gate_up_proj whose SwiGLU adds the update (LoRASiluAndMul): the stacked GEMM's output
        # waits here for it instead of being expanded in place.
        self.defers_expand = False
        self.pending_expand: tuple[torch.Tensor, torch.Tensor] | None = None
        num_ranks = len(layer.shard_ids) * max_rank
        self.lora_a = torch.zeros(num_slots, num_ranks, layer.input_size_per_rank, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, num_ranks, layer.output_size_per_rank, dtype=dtype, device=device)
        # Where each shard's columns start (and the last ends): the expand reads a shard's rank
        # block only for the columns it covers.
        self.slice_bounds = np.cumsum([0] + [layer.shard_rows(shard)[1] for shard in layer.shard_ids]).tolist()
        self.slice_starts = torch.tensor(self.slice_bounds, dtype=torch.int32, device=device)
        # Tensor parallelism (TP's hook): adapters arrive for the whole layer; load_slot keeps this rank's cut.
        self.rank_layer = layer if layer.parallel.size > 1 else None

    # With A stacked under the weight, the tensors live on the layer (``lora_stacked_weight``, a module attribute),
    # so whatever moves a model's tensors (sleep's offload to host memory and back) moves them with the weight, as
    # one storage, and these views follow.
    @property
    def stacked_weight(self) -> torch.Tensor | None:
        """``[out + S * ranks, in]``: the base weight, then every slot's A (None: not stacked)."""
        return None if self._stacked_layer is None else self._stacked_layer.lora_stacked_weight

    @property
    def stacked_bias(self) -> torch.Tensor | None:
        return None if self._stacked_layer is None else self._stacked_layer.lora_stacked_bias

    @property
    def lora_a(self) -> torch.Tensor:
        if self._stacked_layer is None:
            return self._lora_a
        num_slots, num_ranks, in_features = self._lora_a_shape
        return self.stacked_weight[-num_slots * num_ranks:].view(num_slots, num_ranks, in_features)

    @lora_a.setter
    def lora_a(self, value: torch.Tensor) -> None:
        self._lora_a = value
        self._lora_a_shape = tuple(value.shape)

    def stack_a_under_weight(self, layer) -> bool:
        """Keep every slot's A as extra rows under a plain dense base weight (one tensor; the layer's
        weight and ``lora_a`` become views of it), so a LoRA step's base GEMM also yields each token's
        rank-space rows for every slot, ``x @ A[s].T``, as extra output columns: the expand is then the
        only LoRA launch (decode steps are bound by launches, and the separate shrink was a latency-bound
        kernel on long prefills). Costs ``S * ranks`` more rows in the GEMM of a LoRA step (a few
        percent; base-only steps use the weight alone). Returns whether it did (not for quantized or
        CPU-packed weights, a dtype other than the slots', or a sharded layer)."""
        weight = getattr(layer, "weight", None)
        if (type(self.base) is not DenseLinearMethod or getattr(layer, "cpu_weight", None) is not None
                or not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != self.lora_a.dtype
                or weight.device != self.lora_a.device or layer.parallel.size != 1):
            return False
        num_slots, num_ranks, in_features = self.lora_a.shape
        out_features = weight.shape[0]
        stacked = torch.empty(out_features + num_slots * num_ranks, in_features, dtype=weight.dtype,
                              device=weight.device)
        stacked[:out_features].copy_(weight)
        stacked[out_features:].copy_(self.lora_a.reshape(-1, in_features))
        weight.data = stacked[:out_features]
        bias = getattr(layer, "bias", None)
        layer.lora_stacked_weight = stacked
        layer.lora_stacked_bias = None if bias is None else torch.cat([bias.detach(),
                                                                       bias.new_zeros(num_slots * num_ranks)])
        self._lora_a = None  # (the slots' A are rows of the stacked weight now)
        self._stacked_layer = layer
        return True

    def _apply_stacked(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """One GEMM for the base output and every slot's shrink (one row: the batch-1 GEMV), then the expand
        into the base columns in place (a gated MLP's gate_up_proj: left to its SwiGLU). Returns a view (rows
        strided by the extra columns); the consumers of a projection's output (the fused attention-input,
        activation and norm kernels, torch ops) take row strides."""
        return self._finish_stacked(_stacked_matmul(x, self.stacked_weight,
                                                    None if bias is None else self.stacked_bias))

    def _finish_stacked(self, full: torch.Tensor) -> torch.Tensor:
        """The layer's output from the stacked product ``full`` (base columns, then every slot's ranks): the
        expand into the base columns, or, for a gate_up_proj whose SwiGLU adds the update, the hand-off."""
        out_features = self.lora_b.shape[-1]
        y = full[:, :out_features]
        if self.defers_expand:
            if self.pending_expand is not None:
                raise RuntimeError("LoRA: a gate_up_proj output was never given to its SwiGLU (LoRASiluAndMul)")
            self.pending_expand = (y, full[:, out_features:])
            return y
        expand_planned(y, full[:, out_features:], self.step.plan, self.lora_b, self.slice_starts, self.max_rank,
                       slot_stride=self._lora_a_shape[1])
        return y

    def fused_decode_weight(self, layer, x: torch.Tensor) -> torch.Tensor | None:
        """For ``fused_decode`` (the batch-1 GEMVs with the norm or SwiGLU inside): the dense weight its GEMV
        may multiply ``x`` by in place of this layer, whose product :meth:`finish_fused_decode` turns into the
        layer's output: the base weight on a step without adapters, the stacked one on a step with them;
        None where the GEMV must not stand in (no stacked weight, a gate_up_proj expanding in place)."""
        if not self.step.has_adapters:
            return layer.weight if type(self.base) is DenseLinearMethod else None
        if self.stacked_weight is None or not self.step.covers(x) or (len(self.slice_bounds) == 3
                                                                     and not self.defers_expand):
            return None
        return self.stacked_weight

    @property
    def is_plain_now(self) -> bool:
        """Whether this step is the plain dense base method alone (no adapters), so ``fused_decode`` may treat
        the layer as dense (the batch-1 SwiGLU-epilogue MLP: base-only steps of a LoRA engine as fast as the
        base engine's)."""
        return not self.step.has_adapters and self.base is DENSE

    def finish_fused_decode(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output from a GEMV's product over :meth:`fused_decode_weight`."""
        return out if out.shape[1] == self.lora_b.shape[-1] else self._finish_stacked(out)

    def take_pending_expand(self, y: torch.Tensor) -> torch.Tensor | None:
        """The rank-space columns of ``y`` if ``y`` is the output whose update was left to the activation."""
        pending, self.pending_expand = self.pending_expand, None
        if pending is None:
            return None
        if pending[0] is not y:
            raise RuntimeError("LoRA: the SwiGLU got another tensor than its gate_up_proj's output")
        return pending[1]

    def create_weights(self, layer) -> None:
        self.base.create_weights(layer)

    def checkpoint_shape(self, layer, name, num_rows):
        return self.base.checkpoint_shape(layer, name, num_rows)

    def narrow_input(self, loaded, start, size):
        return self.base.narrow_input(loaded, start, size)

    def load_weight(self, layer, name, param, loaded, offset) -> None:
        self.base.load_weight(layer, name, param, loaded, offset)

    def process_weights_after_loading(self, layer) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        step = self.step
        if (step.has_adapters and self.stacked_weight is not None and x.dim() == 2 and step.covers(x)
                and (bias is None or self.stacked_bias is not None)):
            return self._apply_stacked(x, bias)
        if step.has_adapters and step.can_overlap(x):
            return step.apply_overlapped(layer, x, bias, self)
        y = self.base.apply(layer, x, bias)
        if step.has_adapters:  # a host bool: a base-only step launches nothing more
            step.add(y, x, self)
        return y

    def forward_routine(self, layer):
        """The base method's bound routine (the CPU decode fast path) plus the adapter update."""
        base = self.base.forward_routine(layer)
        if base is None:
            return None
        step = self.step

        def routine(x: torch.Tensor) -> torch.Tensor:
            y = base(x)
            if step.has_adapters:
                step.add(y, x, self)
            return y

        return routine

    def load_slot(self, slot: int, shards) -> None:
        """Put an adapter's matrices for this layer into ``slot`` (zeros where it has none).

        Each shard's columns go to the rank block of the slice (q, k, v) they fall in, so B is zero
        outside a block's slice, which the kernels rely on. A shard over several slices (Phi-3's
        pre-fused ``qkv_proj``) is split: each slice's block gets A and that slice's columns of B.
        """
        if self.rank_layer is not None:
            shards = rank_shards(self.rank_layer, shards)
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        bounds = self.slice_bounds
        for shard in shards:
            rank, num_rows = shard.b_scaled.shape
            shard_end = shard.row_start + num_rows
            for piece, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
                first, last = max(start, shard.row_start), min(end, shard_end)
                if first >= last:
                    continue
                first_rank = piece * self.max_rank
                self.lora_a[slot, first_rank:first_rank + rank].copy_(shard.a)
                self.lora_b[slot, first_rank:first_rank + rank, first:last].copy_(
                    shard.b_scaled[:, first - shard.row_start:last - shard.row_start])


class LoRASiluAndMul:
    """A gated MLP's ``act_and_mul`` (SwiGLU) that adds its ``gate_up_proj``'s LoRA update on the way in
    (``kernels.lora.expand_silu_and_mul_planned``) when that projection left it pending, and is plain
    ``kernels.silu_and_mul`` otherwise (base-only steps, unplanned forwards)."""

    def __init__(self, gate_up: LoRALinearMethod) -> None:
        self.gate_up = gate_up

    @property
    def is_plain_now(self) -> bool:
        """Whether this step's SwiGLU is plain ``kernels.silu_and_mul`` (no adapters: nothing can be pending)."""
        return not self.gate_up.step.has_adapters

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shrunk = self.gate_up.take_pending_expand(x)
        if shrunk is None:
            return kernels.silu_and_mul(x)
        method = self.gate_up
        return expand_silu_and_mul_planned(x, shrunk, method.step.plan, method.lora_b, method.max_rank,
                                           method._lora_a_shape[1])


def _defer_gate_up_expands(model, wrapped: dict[str, LoRALinearMethod]) -> None:
    """Where a gated MLP's SwiGLU is ``kernels.silu_and_mul`` and its ``gate_up_proj`` has A stacked under
    its weight, the SwiGLU adds the update (one read of the projection's output instead of the in-place
    expand's read and write, and one launch fewer)."""
    for module in model.modules():
        if type(module) is not GatedMLP or module.act_and_mul is not kernels.silu_and_mul:
            continue
        method = module.gate_up_proj.method
        if isinstance(method, LoRALinearMethod) and method.stacked_weight is not None \
                and len(method.slice_bounds) == 3 and method in wrapped.values():
            method.defers_expand = True
            method.step.deferring_methods.append(method)
            module.act_and_mul = LoRASiluAndMul(method)


def _stacked_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``; one row by the batch-1 Triton GEMV where the base model's fused decode
    would take it (cuBLAS is slow at one row: Llama-3-8B o_proj 13.5 against 10.8 us)."""
    settings = fused_decode  # (read on every call: benchmarks and tests switch them)
    # Any size where the base model's MLP weights go through the GEMVs (its SwiGLU epilogue), as fused_decode does.
    limit = float("inf") if getattr(settings, "SWIGLU_EPILOGUE", False) else getattr(settings, "MAX_WEIGHT_NUMEL", 0)
    if (bias is None and x.dim() == 2 and x.shape[0] <= getattr(settings, "MAX_ROWS", 0)
            and getattr(settings, "ENABLED", False) and getattr(settings, "PLAIN_GEMV", False)
            and x.device.type in getattr(settings, "DEVICE_TYPES", ()) and x.dtype == weight.dtype
            and weight.numel() <= limit):
        gemv = triton_module("hearth_llm.kernels.gemv")
        if gemv is not None:
            return gemv.linear(x, weight)
    return F.linear(x, weight, bias)


def wrap_with_lora(model, num_slots: int, max_rank: int, step: LoRAStep) -> dict[str, LoRALinearMethod]:
    """Wrap every linear layer's method (after loading); returns the wrappers by layer name."""
    wrapped = {}
    layers = linear_layers(model)
    step.allocate(num_slots, max(len(layer.shard_ids) for _, layer in layers) * max_rank if layers else max_rank)
    for name, layer in layers:
        tensors = layer.method_tensors()
        device = tensors[0].device if tensors else step.device
        dtype = _compute_dtype(model, next((t.dtype for t in tensors if t.is_floating_point()), torch.float32))
        if device.type == "cpu":
            dtype = torch.float32  # the CPU path multiplies in float32 (see LoRALinearMethod.apply)
        method = LoRALinearMethod(layer.method, layer, num_slots, max_rank, step, dtype, device)
        if step.stacks_shrink and step.is_planned and not name.endswith(tuple(step.unstacked_layers)):
            # (CUDA; tests plan on the CPU too)
            method.stack_a_under_weight(layer)
        layer.method = method
        layer.routine = method.forward_routine(layer) if layer.parallel.size == 1 else None
        wrapped[name] = method
    if step.defers_gate_up_expand:
        _defer_gate_up_expands(model, wrapped)
    return wrapped


def _compute_dtype(model, fallback: torch.dtype) -> torch.dtype:
    """The activations' dtype: the embedding's (quantized layers may hold int weights)."""
    embed = getattr(model, "embed_tokens", None)
    return embed.weight.dtype if embed is not None else fallback
