"""The adapters an engine serves: known names, a CPU cache of loaded adapters, device slots.

Three tiers, as vLLM's:

* **known** (``list_loras``): name → directory, from ``add_lora`` or a request that brought a path;
* **CPU cache**: up to ``max_cpu_loras`` loaded and checked adapters, least recently used
  dropped first (a known adapter that was dropped is read again on its next request);
* **device slots**: ``max_loras`` slots of every wrapped layer; an adapter is copied into a free
  slot, or the least recently used one that this step does not need, when a step needs it.

The scheduler keeps at most ``max_loras`` distinct adapters running, so a step always fits.
Requests hold the adapter object itself, so removing a name stops new requests from using it
while those already admitted finish with the weights they started with.

Thread-safety: ``add``/``remove``/``list_names``/``resolve`` may be called from any thread (a
lock guards the known names and the cache); ``begin_step`` only from the engine thread.

>>> manager = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=16), torch.device("cpu"), 2048)
>>> manager.add(LoRARequest("sql", "/adapters/sql"))
>>> manager.list_names()
['sql']
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..models.lora_linear import LoRAStep, wrap_with_lora
from .adapter import LoRAAdapter, LoRATargets, load_adapter
from .request import LoRARequest


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """``max_loras`` device slots (distinct adapters per step), ``max_lora_rank`` (largest ``r``
    accepted; slots are sized for it), ``max_cpu_loras`` loaded adapters kept on the CPU."""

    max_loras: int = 8
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


class LoRAManager:
    """See the module docstring."""

    def __init__(self, model, config: LoRAConfig, device: torch.device, max_num_tokens: int) -> None:
        self.config = config
        self.targets = LoRATargets.of(model)
        self.step = LoRAStep(max_num_tokens, device)
        self.layers = wrap_with_lora(model, config.max_loras, config.max_lora_rank, self.step)
        self._lock = threading.Lock()
        self._paths: dict[str, str] = {}
        self._cpu_cache: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._slot_of: OrderedDict[str, int] = OrderedDict()   # cache_key -> slot, least recent first
        self.num_slot_loads = 0

    # ---- known adapters (any thread) --------------------------------------------------------

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Load, check and remember an adapter; ``ValueError`` naming the adapter if it is bad
        or its name is taken by another directory."""
        adapter = self.resolve(request)
        self.remember(adapter)
        return adapter

    def remove(self, name: str) -> bool:
        """Forget ``name`` (requests already admitted finish with it); False if unknown."""
        with self._lock:
            self._cpu_cache.pop(name, None)
            return self._paths.pop(name, None) is not None

    def list_names(self) -> list[str]:
        with self._lock:
            return sorted(self._paths)

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter a request asks for, loaded (from the cache, or its directory) and checked.
        Changes no known names: :meth:`remember` does, once the request is admitted."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        with self._lock:
            known_path = self._paths.get(request.name)
            cached = self._cpu_cache.get(request.name)
            if cached is not None and request.path in (None, known_path):
                self._cpu_cache.move_to_end(request.name)
                return cached
        if known_path is not None and request.path is not None and request.path != known_path:
            raise ValueError(f"LoRA adapter {request.name!r} is already loaded from {known_path}; remove_lora it "
                             f"first or use another name for {request.path}")
        if known_path is None and request.path is None:
            raise ValueError(f"unknown LoRA adapter {request.name!r}; known: {self.list_names()}. Pass its path "
                             "(LoRARequest(name, path)) or add_lora it first")
        path = request.path or known_path
        adapter = load_adapter(LoRARequest(request.name, path), self.targets, self.config.max_lora_rank)
        self._cache(adapter)
        return adapter

    def remember(self, adapter: LoRAAdapter) -> None:
        """Make ``adapter``'s name known (to :meth:`list_names` and later requests by name)."""
        with self._lock:
            known = self._paths.setdefault(adapter.name, adapter.path)
        if known == adapter.path:
            self._cache(adapter)

    def _cache(self, adapter: LoRAAdapter) -> None:
        with self._lock:
            self._cpu_cache[adapter.name] = adapter
            self._cpu_cache.move_to_end(adapter.name)
            while len(self._cpu_cache) > self.config.num_cpu_loras:
                self._cpu_cache.popitem(last=False)

    # ---- device slots (engine thread) -------------------------------------------------------

    def begin_step(self, adapters: list[LoRAAdapter | None], num_new_tokens: list[int]) -> None:
        """Put this step's adapters into slots and set each token's slot for the forward pass."""
        needed = {a.cache_key: a for a in adapters if a is not None}
        if len(needed) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(needed)} adapters exceeds max_loras={self.config.max_loras}")
        slot_of_seq = [-1 if a is None else self._slot_for(a, needed) for a in adapters]
        self.step.begin_sequences(slot_of_seq, num_new_tokens)

    def end_step(self) -> None:
        self.step.end()

    @property
    def has_adapters(self) -> bool:
        """Whether the step set by :meth:`begin_step` runs any adapter (else: the base model exactly)."""
        return self.step.has_adapters

    def capturing(self):
        """A context in which captured CUDA graphs hold the LoRA path (see ``LoRAStep.capturing``)."""
        return self.step.capturing()

    def _slot_for(self, adapter: LoRAAdapter, needed: dict[str, LoRAAdapter]) -> int:
        slot = self._slot_of.get(adapter.cache_key)
        if slot is None:
            slot = self._free_slot(needed)
            for name, method in self.layers.items():
                method.load_slot(slot, adapter.layers.get(name, ()))
            self._slot_of[adapter.cache_key] = slot
            self.num_slot_loads += 1
        self._slot_of.move_to_end(adapter.cache_key)
        return slot

    def _free_slot(self, needed: dict[str, LoRAAdapter]) -> int:
        if len(self._slot_of) < self.config.max_loras:
            return len(self._slot_of)
        victim = next(key for key in self._slot_of if key not in needed)  # least recently used first
        return self._slot_of.pop(victim)

    @property
    def resident(self) -> list[str]:
        """Cache keys of the adapters in device slots, least recently used first."""
        return list(self._slot_of)
