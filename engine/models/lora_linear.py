"""A linear method that adds batched LoRA updates on top of any other method (dense, GGUF, FP8...).

:func:`wrap_with_lora` puts a :class:`LoRALinearMethod` around each linear layer's current
method after the model has loaded: the base weights and their packing are untouched, the base
method still computes ``x @ W.T + b``, and the wrapper adds each token's adapter update from the
layer's slot tensors (``lora_a`` ``[S, blocks * max_rank, in]``, ``lora_b`` ``[S, blocks *
max_rank, out]``; one rank block per shard, so q, k and v of a fused ``qkv_proj`` each keep their
own A and B). Which slot each token uses is the step's :class:`LoRAStep`, which the model
runner fills before every forward pass: an explicit object handed to every wrapper at wrap time,
since the model's forward signature carries no adapter inputs.

>>> step = LoRAStep(capacity=2048, device=torch.device("cpu"))
>>> wrapped = wrap_with_lora(model, num_slots=8, max_rank=16, step=step)
>>> sorted(wrapped)[:2]
['layers.0.mlp.down_proj', 'layers.0.mlp.gate_up_proj']
"""
from __future__ import annotations

import torch

from hearth_llm.kernels.lora import add_lora

from .linear import linear_layers
from .linear_method import LinearMethod


class LoRAStep:
    """The current forward pass's adapter inputs, shared by every wrapped layer.

    ``token_slots`` (on the device, ``capacity`` long, ``-1`` = base model) is a fixed buffer so
    CUDA graphs captured with the LoRA path read each replay's slots. On the CPU the step also
    keeps a compact form: only the slots this step uses (a slice when they are consecutive) and
    the tokens' indices into them, so the reference kernel's cost grows with the adapters in the
    batch, not with ``max_loras``.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.token_slots = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.has_adapters = False
        self.num_tokens = 0
        self.used_slots: slice | torch.Tensor = slice(0, 0)
        self.compact_token_slots = self.token_slots[:0]
        self.is_single_adapter = False

    def begin(self, token_slots: list[int] | torch.Tensor) -> None:
        """Set this step's slot per token (``-1`` for base-model tokens)."""
        slots = torch.as_tensor(token_slots, dtype=torch.long)
        self.num_tokens = len(slots)
        if self.num_tokens > len(self.token_slots):
            # Never a new buffer: captured CUDA graphs read this one. The runner sizes it for the
            # step's token budget, so this is a bug, and failing the step beats wrong adapters.
            raise RuntimeError(f"a step of {self.num_tokens} tokens exceeds the LoRA slot buffer "
                               f"({len(self.token_slots)})")
        self.has_adapters = bool((slots >= 0).any())
        self.token_slots[:self.num_tokens].copy_(slots, non_blocking=True)
        if self.device.type == "cpu" and self.has_adapters:
            self._compact(slots)

    def end(self) -> None:
        """After the forward pass: a forward the runner did not prepare (a pooling pass, a graph
        warm-up) runs the base model. On CUDA the kernels always run, so the slots go back to -1
        (stream-ordered after this pass's kernels)."""
        self.has_adapters = False
        self.token_slots.fill_(-1)

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
        num_ranks = len(layer.shard_ids) * max_rank
        self.lora_a = torch.zeros(num_slots, num_ranks, layer.input_size_per_rank, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, num_ranks, layer.output_size_per_rank, dtype=dtype, device=device)

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
        y = self.base.apply(layer, x, bias)
        step = self.step
        if x.is_cuda:
            # Always, even with no adapter in the step: CUDA graphs (warm-up and capture run with
            # none) must hold the kernels for replays that have adapters. Base tokens load nothing.
            if x.shape[0] <= len(step.token_slots):  # (a larger forward is not the runner's: base)
                add_lora(y, x, step.token_slots[:x.shape[0]], self.lora_a, self.lora_b)
            return y
        if not step.has_adapters or x.shape[0] != step.num_tokens:
            return y
        used = step.used_slots
        x = x.to(self.lora_a.dtype)  # float32 slots on the CPU: small bf16 matmuls are slow there
        if step.is_single_adapter:  # every token on one adapter (a batch-1 decode): two plain matmuls
            y += (x @ self.lora_a[used][0].T) @ self.lora_b[used][0]
            return y
        add_lora(y, x, step.compact_token_slots, self.lora_a[used], self.lora_b[used])
        return y

    def load_slot(self, slot: int, shards) -> None:
        """Put an adapter's matrices for this layer into ``slot`` (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for shard in shards:
            first_rank = shard.block * self.max_rank
            rank, num_rows = shard.b_scaled.shape
            self.lora_a[slot, first_rank:first_rank + rank].copy_(shard.a)
            self.lora_b[slot, first_rank:first_rank + rank, shard.row_start:shard.row_start + num_rows].copy_(
                shard.b_scaled)


def wrap_with_lora(model, num_slots: int, max_rank: int, step: LoRAStep) -> dict[str, LoRALinearMethod]:
    """Wrap every linear layer's method (after loading); returns the wrappers by layer name."""
    wrapped = {}
    for name, layer in linear_layers(model):
        tensors = layer.method_tensors()
        device = tensors[0].device if tensors else step.device
        dtype = _compute_dtype(model, next((t.dtype for t in tensors if t.is_floating_point()), torch.float32))
        if device.type == "cpu":
            dtype = torch.float32  # the CPU path multiplies in float32 (see LoRALinearMethod.apply)
        method = LoRALinearMethod(layer.method, layer, num_slots, max_rank, step, dtype, device)
        layer.method = method
        wrapped[name] = method
    return wrapped


def _compute_dtype(model, fallback: torch.dtype) -> torch.dtype:
    """The activations' dtype: the embedding's (quantized layers may hold int weights)."""
    embed = getattr(model, "embed_tokens", None)
    return embed.weight.dtype if embed is not None else fallback
