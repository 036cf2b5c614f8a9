"""What the driver sends a worker each step, and how tensors cross the process boundary.

A :class:`~..batch.ScheduledBatch` holds live :class:`~..request.Request` objects (sampling
state, grammar futures, generators) that neither pickle nor belong on a worker. The worker's
model runner reads only a few fields of each; :func:`step_message` copies exactly those into
:class:`StepRequest` (with only the tokens this step feeds, not the whole sequence), and the
worker rebuilds a batch of them. Logits come back as numpy arrays (tensors pickled through a
pipe would go through shared-memory file descriptors, one per tensor).

>>> message = step_message(batch, pending_token_ids)
>>> worker_batch = message.to_batch()          # on the worker: what ModelRunner.run reads
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..batch import ForwardOutput, ScheduledBatch


class TokenTail:
    """A sequence's tokens from ``offset`` on, indexed by absolute position like the full list."""

    __slots__ = ("offset", "tokens")

    def __init__(self, offset: int, tokens: list[int]) -> None:
        self.offset, self.tokens = offset, tokens

    def __getitem__(self, index: slice | int) -> "list[int] | int":
        if isinstance(index, int):  # one token, as the few-decodes step builder reads it
            if not self.offset <= index < self.offset + len(self.tokens):
                raise IndexError(f"token {index} was not sent to the worker (it has tokens {self.offset} on)")
            return self.tokens[index - self.offset]
        start = self.offset if index.start is None else index.start
        if start < self.offset:
            raise IndexError(f"token {start} was not sent to the worker (it has tokens {self.offset} on)")
        stop = None if index.stop is None else index.stop - self.offset
        return self.tokens[start - self.offset:stop]


@dataclass(slots=True)
class StepRequest:
    """The fields of a :class:`~..request.Request` the model runner reads to build a step's inputs."""

    token_ids: TokenTail
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    num_pending_tokens: int
    pending_row: int
    block_ids: list[int]
    wants_prompt_logprobs: bool
    lora: object = None   # on the wire the adapter's cache_key; on the worker its LoRAAdapter (to_batch)


@dataclass(slots=True)
class StepMessage:
    """One step for every rank: the batch, and the previous step's sampled ids when a request is
    fed one it has not seen on the host yet (async scheduling)."""

    requests: list[StepRequest]
    num_new_tokens: list[int]
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    pending_token_ids: list[int] | None = None
    adapters: ShippedAdapters | None = None  # LoRA: adapters the workers have not been sent yet

    def to_batch(self, adapter_store: dict | None = None) -> ScheduledBatch:
        """The batch the worker's runner reads; with LoRA, ``adapter_store`` (the worker's adapters by
        cache_key, kept across steps) takes this step's new adapters and gives each request its own."""
        if self.adapters is not None:
            self.adapters.apply_to(adapter_store)
            for request in self.requests:
                if request.lora is not None:
                    request.lora = adapter_store[request.lora]
        return ScheduledBatch(requests=self.requests, num_new_tokens=self.num_new_tokens,
                              spec_token_ids=self.spec_token_ids)

    def pending_tensor(self, device: torch.device) -> torch.Tensor | None:
        if self.pending_token_ids is None:
            return None
        return torch.tensor(self.pending_token_ids, dtype=torch.long, device=device)


def step_message(batch: ScheduledBatch, pending_token_ids: torch.Tensor | None,
                 shipper: AdapterShipper | None = None) -> StepMessage:
    requests = [_step_request(request) for request in batch.requests]
    has_pending = pending_token_ids is not None and any(r.num_pending_tokens for r in requests)
    adapters = None
    if shipper is not None:
        adapters = shipper.ship([getattr(request, "lora", None) for request in batch.requests])
    return StepMessage(requests, list(batch.num_new_tokens), dict(batch.spec_token_ids),
                       pending_token_ids.tolist() if has_pending else None, adapters)


def _step_request(request) -> StepRequest:
    start = request.num_computed_tokens
    lora = getattr(request, "lora", None)
    return StepRequest(TokenTail(start, request.token_ids[start:]), start, request.num_tokens,
                       request.num_prompt_tokens, request.num_pending_tokens, request.pending_row,
                       list(request.block_ids), request.wants_prompt_logprobs,
                       None if lora is None else lora.cache_key)


# ---- LoRA adapters to the workers --------------------------------------------------------------

@dataclass(slots=True)
class ShippedAdapters:
    """A step's adapter traffic: adapters new to the workers (whole, as numpy), and the cache keys
    they may forget (the driver decides, so every rank keeps the same ones)."""

    new: dict[str, "WireAdapter"] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    def apply_to(self, store: dict) -> None:
        for key in self.dropped:
            store.pop(key, None)
        for key, wire in self.new.items():
            store[key] = wire.adapter()


class AdapterShipper:
    """The driver's record of the adapters its workers hold: each is sent once, when a step first
    needs it; the least recently needed beyond ``capacity`` (at least a step's ``max_loras``) are
    dropped. The workers' own LoRA managers then put them into slots, each rank cutting its slice."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._sent: OrderedDict[str, None] = OrderedDict()

    def ship(self, adapters: list) -> ShippedAdapters | None:
        needed = {adapter.cache_key: adapter for adapter in adapters if adapter is not None}
        if not needed:
            return None
        shipped = ShippedAdapters()
        for key, adapter in needed.items():
            if key in self._sent:
                self._sent.move_to_end(key)
            else:
                self._sent[key] = None
                shipped.new[key] = WireAdapter.of(adapter)
        while len(self._sent) > max(self.capacity, len(needed)):
            shipped.dropped.append(self._sent.popitem(last=False)[0])  # never one of this step's: they are last
        return shipped


@dataclass(slots=True)
class WireAdapter:
    """A :class:`~..lora.adapter.LoRAAdapter` with its matrices as numpy arrays (see WireTensor)."""

    name: str
    path: str
    rank: int
    scaling: float
    cache_key: str
    layers: dict[str, list[tuple[int, int, "WireTensor", "WireTensor"]]]

    @classmethod
    def of(cls, adapter) -> "WireAdapter":
        layers = {name: [(s.block, s.row_start, WireTensor.of(s.a), WireTensor.of(s.b_scaled)) for s in shards]
                  for name, shards in adapter.layers.items()}
        return cls(adapter.name, adapter.path, adapter.rank, adapter.scaling, adapter.cache_key, layers)

    def adapter(self):
        from ..lora.adapter import LoRAAdapter, ShardLoRA

        cpu = torch.device("cpu")
        layers = {name: [ShardLoRA(block, row_start, a.to(cpu), b.to(cpu)) for block, row_start, a, b in shards]
                  for name, shards in self.layers.items()}
        return LoRAAdapter(self.name, self.path, self.rank, self.scaling, self.cache_key, layers)


# ---- tensors over a pipe ---------------------------------------------------------------------

@dataclass(slots=True)
class WireTensor:
    """A tensor as a numpy array; bf16 (which numpy lacks) travels as its int16 bits."""

    array: np.ndarray
    dtype: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "WireTensor":
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            return cls(tensor.view(torch.int16).numpy(), "bfloat16")
        return cls(tensor.numpy(), str(tensor.dtype).removeprefix("torch."))

    def to(self, device: torch.device) -> torch.Tensor:
        tensor = torch.from_numpy(self.array)
        if self.dtype == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        return tensor.to(device)


@dataclass(slots=True)
class WireOutput:
    """A :class:`~..batch.ForwardOutput` on its way back from rank 0."""

    logits: WireTensor
    sampling_rows: list[int]
    prompt_logits: dict[int, WireTensor]

    @classmethod
    def of(cls, output: ForwardOutput) -> "WireOutput":
        return cls(WireTensor.of(output.logits), list(output.sampling_rows),
                   {index: WireTensor.of(t) for index, t in output.prompt_logits.items()})

    def to(self, device: torch.device) -> ForwardOutput:
        return ForwardOutput(logits=self.logits.to(device), sampling_rows=self.sampling_rows,
                             prompt_logits={index: t.to(device) for index, t in self.prompt_logits.items()})
