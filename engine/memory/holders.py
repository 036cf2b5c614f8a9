"""What engines book against their device's budget: an LLM engine's weights and KV cache
(:class:`EngineMemory`, which gives back free KV blocks on demand), an embedding engine's weights
(:func:`book_weights`)."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .budget import MemoryBudget, MemoryBudgetError, get_memory_budget
from .kv_cache import kv_cache_bytes, kv_floor_blocks, num_reclaimable_blocks, shrink_kv_cache
from .weights import weights_bytes

logger = logging.getLogger("hearth_llm")

# An engine sized automatically gets at least this much context (or its model's, if shorter).
MIN_AUTO_CONTEXT_TOKENS = 2048
# A shrink waits this long for the engine's step to end; past it the engine gives nothing back.
STEP_LOCK_TIMEOUT_S = 30.0
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
GPU_KV_FRACTION_OF_FREE = 0.9


@dataclass(slots=True)
class LoadPlan:
    """What an engine asks of its budget before its weights are read."""

    weights_bytes: int
    kv_wanted_bytes: int | None   # None: as much as its share
    kv_minimum_bytes: int
    minimum_tokens: int


def plan_load(checkpoint, config) -> LoadPlan:
    """Weights (the model built on the ``meta`` device: shapes, no memory) and KV sizes for
    ``config``: ``kv_cache_memory`` exactly when given, else 1 GiB on the CPU (the runner's default)
    and on a GPU its share of the budget (capped by the device's real free memory once granted:
    :meth:`EngineMemory.reserve_for_load`); at least one ``max_model_len`` or
    :data:`MIN_AUTO_CONTEXT_TOKENS` sequence."""
    from ..models import model_class_for

    dtype, device = config.torch_dtype, config.torch_device
    model_class = model_class_for(checkpoint.config)
    arch = model_class.arch_from_hf_config(checkpoint.config)
    with torch.device("meta"):
        model = model_class(arch)
    element_size = torch.empty((), dtype=dtype).element_size()
    # Floating tensors counted in ``dtype`` without casting on meta (``.to`` there costs a cold start ~1 s)
    weights = sum(t.numel() * (element_size if t.is_floating_point() else t.element_size())
                  for t in [*model.parameters(), *model.buffers()])
    kv_element_size = torch.empty((), dtype=config.kv_cache_torch_dtype).element_size()  # 1 for an fp8 cache
    bytes_per_block = (2 * arch.num_hidden_layers * config.block_size * arch.num_key_value_heads * arch.head_dim
                       * kv_element_size)
    tokens = config.max_model_len or min(arch.max_position_embeddings, MIN_AUTO_CONTEXT_TOKENS)
    minimum = -(-tokens // config.block_size) * bytes_per_block
    if config.kv_cache_memory is not None:
        return LoadPlan(weights, config.kv_cache_memory, config.kv_cache_memory, tokens)
    if device.type == "cuda":
        return LoadPlan(weights, None, minimum, tokens)
    return LoadPlan(weights, max(minimum, DEFAULT_CPU_KV_CACHE_BYTES), minimum, tokens)


class EngineMemory:
    """One :class:`EngineCore`'s share of its device's budget.

    It reserves before the weights load, books what the loaded engine holds, and gives back
    free KV blocks when another engine needs them: under the core's step lock, so between steps.
    ``on_resized(engine)`` runs (under that lock) after such a shrink: an idle engine takes no
    step after it, so this is where its core refreshes the counters its ``stats()`` reports.

    >>> memory = EngineMemory("engine 'default'", torch.device("cpu"), step_lock)
    >>> kv_bytes = memory.reserve_for_load(plan_load(checkpoint, config))
    """

    def __init__(self, name: str, device: torch.device, step_lock: threading.Lock,
                 on_resized: Callable[[object], None] | None = None) -> None:
        self.name = name
        self.device = device
        self._step_lock = step_lock
        self._on_resized = on_resized
        self._budget: MemoryBudget | None = None
        self.engine = None
        self.bytes_per_block = 0
        self.loaded_weights_bytes = 0
        self.state = "loading"              # then "serving", "asleep", "closed"
        self.sleep_level: int | None = None

    @property
    def budget(self) -> MemoryBudget:
        """Made on first use: a GPU's budget asks the device its size."""
        if self._budget is None:
            self._budget = get_memory_budget(self.device)
        return self._budget

    # ---- the engine's side -------------------------------------------------------------------

    def reserve_for_load(self, plan: LoadPlan) -> int:
        """The KV bytes granted; raises :class:`MemoryBudgetError`, booking nothing, if even the
        minimum does not fit."""
        granted = self.budget.reserve(self, plan.weights_bytes, plan.kv_wanted_bytes, plan.kv_minimum_bytes,
                                      what=f"{plan.minimum_tokens} tokens")
        if self.device.type == "cuda" and plan.kv_wanted_bytes is None:
            granted = self._within_free_gpu_memory(plan, granted)
        return granted

    def _within_free_gpu_memory(self, plan: LoadPlan, granted: int) -> int:
        """The budget counts only this process's engines: as before budgets, an automatic KV cache
        also keeps to 90 % of what the device really has free after the weights (other
        processes, activations, CUDA graphs)."""
        free, _ = torch.cuda.mem_get_info(self.device)
        real = int((free - plan.weights_bytes) * GPU_KV_FRACTION_OF_FREE)
        if real >= granted:
            return granted
        if real < plan.kv_minimum_bytes:
            self.budget.release(self)
            raise MemoryBudgetError(
                f"{self.name} fits its {self.budget.device} memory budget but not the device: "
                f"{free / 2**30:.2f} GiB are free, it needs {(plan.weights_bytes + plan.kv_minimum_bytes) / 2**30:.2f} "
                f"GiB (weights + KV cache for {plan.minimum_tokens} tokens) with 10 % kept aside; another process "
                f"may hold the GPU, or lower the budget (hearth_llm.engine.set_memory_budget)")
        self.budget.book(self, plan.weights_bytes, real)
        return real

    def book_loaded(self, engine) -> None:
        """Book what the loaded engine really holds (the plan was an estimate)."""
        self.engine = engine
        self.bytes_per_block = kv_cache_bytes(engine) // max(1, engine.runner.num_blocks)
        self.loaded_weights_bytes = weights_bytes(engine.runner.model) + _draft_bytes(engine)
        self.state = "serving"
        self.budget.book(self, self.loaded_weights_bytes, kv_cache_bytes(engine))
        if self.budget.num_unreserved_bytes < 0:
            logger.warning("%s holds more than planned: the %s memory budget is over by %d bytes", self.name,
                           self.budget.device, -self.budget.num_unreserved_bytes)

    def book_asleep(self, state) -> None:
        """Asleep, it holds its weights on the device only at level 1 on the CPU."""
        self.state, self.sleep_level = "asleep", state.level
        self.budget.book(self, self.loaded_weights_bytes if state.keeps_weights_on_device else 0, 0)

    def reserve_for_wake(self, state) -> int:
        """The blocks the woken cache may have: as many as before if they fit, at least the floor."""
        floor = kv_floor_blocks(self.engine)
        granted = self.budget.reserve(self, self.loaded_weights_bytes, state.num_blocks * self.bytes_per_block,
                                      floor * self.bytes_per_block, what=f"{self.engine.max_model_len} tokens")
        return granted // self.bytes_per_block

    def book_awake(self) -> None:
        self.state, self.sleep_level = "serving", None
        self.budget.book(self, self.loaded_weights_bytes, kv_cache_bytes(self.engine))

    def release_all(self) -> None:
        self.state = "closed"
        if self._budget is not None:
            self._budget.release(self)

    def stats(self) -> dict:
        """This engine's share, for ``EngineCore.stats()``."""
        booking = self._budget.booking_of(self) if self._budget is not None else None
        return {"weights_bytes": 0 if booking is None else booking.weights_bytes,
                "kv_cache_bytes": 0 if booking is None else booking.kv_cache_bytes,
                "memory_device": str(self.device), "is_sleeping": self.state == "asleep",
                "sleep_level": self.sleep_level}

    # ---- the budget's side -------------------------------------------------------------------

    def reclaimable_kv_bytes(self) -> int:
        engine = self.engine
        if engine is None or self.state != "serving":
            return 0
        return num_reclaimable_blocks(engine) * self.bytes_per_block

    def release_kv(self, num_bytes: int) -> int:
        if not self._step_lock.acquire(timeout=STEP_LOCK_TIMEOUT_S):
            logger.warning("%s was busy for %s s and gave back no KV blocks", self.name, STEP_LOCK_TIMEOUT_S)
            return 0
        try:
            engine = self.engine
            if engine is None or self.state != "serving":   # loading, asleep or closed: nothing to give
                return 0
            before = kv_cache_bytes(engine)
            shrink_kv_cache(engine, engine.runner.num_blocks - -(-num_bytes // self.bytes_per_block))
            self.budget.book(self, self.loaded_weights_bytes, kv_cache_bytes(engine))
            released = before - kv_cache_bytes(engine)
            if released and self._on_resized is not None:
                self._on_resized(engine)
            logger.info("%s gave back %d KV blocks (%d bytes) to the %s memory budget", self.name,
                        released // self.bytes_per_block, released, self.budget.device)
            return released
        finally:
            self._step_lock.release()


def _draft_bytes(engine) -> int:
    """A draft model's weights and KV cache (speculative decoding), which stay as they are."""
    runner = getattr(getattr(engine, "proposer", None), "runner", None)
    if runner is None:
        return 0
    cache = getattr(runner, "kv_cache", None)
    return weights_bytes(runner.model) + (0 if cache is None else cache.numel() * cache.element_size())


class WeightsBooking:
    """A fixed booking: an embedding engine's weights (it has no KV cache to give back).

    >>> booking = book_weights(torch.device("cpu"), "embedding engine 'all-MiniLM-L6-v2'", model)
    >>> booking.release()
    """

    def __init__(self, name: str, budget: MemoryBudget) -> None:
        self.name = name
        self.budget = budget
        self.state = "serving"

    def reclaimable_kv_bytes(self) -> int:
        return 0

    def release_kv(self, num_bytes: int) -> int:
        return 0

    def release(self) -> None:
        self.state = "closed"
        self.budget.release(self)


def book_weights(device: torch.device | str, name: str, model: nn.Module | int) -> WeightsBooking:
    """Book a model's weights (or a byte count) on ``device``'s budget; other engines give back
    free KV blocks if needed. Raises :class:`MemoryBudgetError` when it does not fit."""
    booking = WeightsBooking(name, get_memory_budget(device))
    num_bytes = model if isinstance(model, int) else weights_bytes(model)
    booking.budget.reserve(booking, num_bytes, 0, 0)
    return booking
