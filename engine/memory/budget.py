"""One memory budget per device, shared by every engine in the process.

Engines book what they hold on their device (weights and KV cache) against the device's
:class:`MemoryBudget`. A new engine that does not fit takes free KV blocks back from the engines
already there (never blocks a request holds, never below one ``max_model_len`` sequence each), or
is refused with :class:`MemoryBudgetError` before its weights are read, naming who holds what.

>>> from hearth_llm.engine import set_memory_budget, memory_report
>>> set_memory_budget("cuda", 0.8)          # 80 % of the GPU for every engine in this process
>>> set_memory_budget("cpu", "6GiB")
>>> memory_report()["cpu"]["engines"]       # [{'name': ..., 'weights_bytes': ..., 'kv_cache_bytes': ...}]

The default is 90 % of a GPU's memory and 80 % of the RAM this process may use on the CPU.
The books cover weights and KV caches; activations, CUDA graphs and allocator slack are not in
them, which is why the default leaves 10 % of a GPU aside.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

DEFAULT_GPU_FRACTION = 0.9
DEFAULT_CPU_FRACTION = 0.8


class MemoryBudgetError(RuntimeError):
    """An engine does not fit its device's memory budget, even after the other engines gave back
    their free KV blocks; the message says how much it needs and who holds what."""


class BudgetHolder(Protocol):
    """What an engine offers its budget: a name, and free KV memory it can give back."""

    name: str

    def reclaimable_kv_bytes(self) -> int:
        """KV bytes it could give back now: free blocks above its floor (an estimate)."""

    def release_kv(self, num_bytes: int) -> int:
        """Give back at least ``num_bytes`` of free KV blocks if it can; returns the bytes released
        (it books the smaller cache itself, through :meth:`MemoryBudget.book`)."""


@dataclass(slots=True)
class Booking:
    weights_bytes: int = 0
    kv_cache_bytes: int = 0

    @property
    def num_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


class MemoryBudget:
    """The bytes engines may hold on one device, and who holds them.

    >>> budget = get_memory_budget("cpu")
    >>> budget.capacity_bytes, budget.num_unreserved_bytes
    """

    def __init__(self, device: torch.device, capacity_bytes: int) -> None:
        self.device = device
        self.capacity_bytes = capacity_bytes
        self._books_lock = threading.Lock()        # the books; held briefly, never while calling out
        self._reserve_lock = threading.RLock()     # one reservation at a time (it may shrink others)
        self._bookings: dict[BudgetHolder, Booking] = {}

    @property
    def num_reserved_bytes(self) -> int:
        with self._books_lock:
            return sum(booking.num_bytes for booking in self._bookings.values())

    @property
    def num_unreserved_bytes(self) -> int:
        return self.capacity_bytes - self.num_reserved_bytes

    def booking_of(self, holder: BudgetHolder) -> Booking | None:
        with self._books_lock:
            booking = self._bookings.get(holder)
            return None if booking is None else Booking(booking.weights_bytes, booking.kv_cache_bytes)

    def reserve(self, holder: BudgetHolder, weights_bytes: int, kv_wanted_bytes: int | None,
                kv_minimum_bytes: int, what: str = "") -> int:
        """Book ``weights_bytes`` plus a KV cache for ``holder`` and return the KV bytes granted:
        ``kv_wanted_bytes`` (None: as much as its fair share) when that fits, else less but at least
        ``kv_minimum_bytes``, taking free KV blocks back from other engines as needed.

        Raises :class:`MemoryBudgetError` (and books nothing, shrinks nobody) when even the minimum
        does not fit. ``what`` describes the minimum in the message (e.g. "2048 tokens").
        """
        with self._reserve_lock:
            others = [h for h in self._holders() if h is not holder]
            own = self.booking_of(holder) or Booking()
            available = self.num_unreserved_bytes + own.num_bytes
            reclaimable = {h: max(0, h.reclaimable_kv_bytes()) for h in others}
            needed = weights_bytes + kv_minimum_bytes
            if needed > available + sum(reclaimable.values()):
                raise MemoryBudgetError(self._refusal(holder, weights_bytes, kv_minimum_bytes, what, available,
                                                      reclaimable))
            target = self._kv_target(weights_bytes, kv_wanted_bytes, kv_minimum_bytes, available, others)
            shortfall = weights_bytes + target - available
            for other in sorted(others, key=lambda h: -reclaimable[h]):
                if shortfall <= 0:
                    break
                if reclaimable[other] > 0:
                    shortfall -= other.release_kv(min(shortfall, reclaimable[other]))
            available = self.num_unreserved_bytes + own.num_bytes
            if weights_bytes + kv_minimum_bytes > available:   # someone's blocks were taken meanwhile
                raise MemoryBudgetError(self._refusal(holder, weights_bytes, kv_minimum_bytes, what, available, {}))
            granted = min(target, available - weights_bytes)
            self.book(holder, weights_bytes, granted)
            return granted

    def _kv_target(self, weights_bytes: int, kv_wanted: int | None, kv_minimum: int, available: int,
                   others: list[BudgetHolder]) -> int:
        """What the newcomer asks for: all it wants if it is unreserved; otherwise an equal share of
        the KV room among the engines with a KV cache, never more than it wants."""
        free_room = available - weights_bytes
        if kv_wanted is not None and kv_wanted <= free_room:
            return kv_wanted
        with self._books_lock:
            num_weights = sum(b.weights_bytes for h, b in self._bookings.items() if h in others)
            num_with_kv = sum(1 for h, b in self._bookings.items() if h in others and b.kv_cache_bytes > 0)
        fair_share = (self.capacity_bytes - num_weights - weights_bytes) // (num_with_kv + 1)
        target = max(free_room, fair_share)
        if kv_wanted is not None:
            target = min(target, kv_wanted)
        return max(target, kv_minimum)

    def book(self, holder: BudgetHolder, weights_bytes: int, kv_cache_bytes: int) -> None:
        """Record what ``holder`` holds now (after a load, a shrink, a sleep or a wake)."""
        with self._books_lock:
            self._bookings[holder] = Booking(int(weights_bytes), int(kv_cache_bytes))

    def release(self, holder: BudgetHolder) -> None:
        """``holder`` holds nothing any more (closed, or refused)."""
        with self._books_lock:
            self._bookings.pop(holder, None)

    def set_capacity(self, capacity_bytes: int) -> None:
        """Change the budget; engines over it first give back free KV blocks, else this raises
        :class:`MemoryBudgetError` and the budget keeps its old capacity."""
        with self._reserve_lock:
            excess = self.num_reserved_bytes - capacity_bytes
            for holder in sorted(self._holders(), key=lambda h: -h.reclaimable_kv_bytes()):
                if excess <= 0:
                    break
                excess -= holder.release_kv(excess)
            if excess > 0:
                raise MemoryBudgetError(
                    f"cannot set the {self.device} memory budget to {_mib(capacity_bytes)}: the engines hold "
                    f"{_mib(self.num_reserved_bytes)} and cannot give back more. Held: {self._holdings()}")
            self.capacity_bytes = capacity_bytes

    def report(self) -> dict:
        """The budget and each engine's share, as plain data (``hearth-llm info``, ``LLM.stats()``)."""
        with self._books_lock:
            engines = [{"name": holder.name, "weights_bytes": b.weights_bytes, "kv_cache_bytes": b.kv_cache_bytes}
                       for holder, b in self._bookings.items()]
        reserved = sum(e["weights_bytes"] + e["kv_cache_bytes"] for e in engines)
        return {"device": str(self.device), "capacity_bytes": self.capacity_bytes, "reserved_bytes": reserved,
                "unreserved_bytes": self.capacity_bytes - reserved, "engines": engines}

    def _holders(self) -> list[BudgetHolder]:
        with self._books_lock:
            return list(self._bookings)

    def _refusal(self, holder, weights_bytes, kv_minimum, what, available, reclaimable) -> str:
        kv_text = f"KV cache {_mib(kv_minimum)}" + (f" for {what}" if what else "")
        return (f"{holder.name} does not fit the {self.device} memory budget: it needs at least "
                f"{_mib(weights_bytes + kv_minimum)} (weights {_mib(weights_bytes)} + {kv_text}); the budget of "
                f"{_mib(self.capacity_bytes)} has {_mib(max(0, available))} unreserved and "
                f"{_mib(sum(reclaimable.values()))} in free KV blocks other engines could give back. "
                f"Held: {self._holdings(reclaimable)}. Raise the budget (hearth_llm.engine.set_memory_budget"
                f"({str(self.device.type)!r}, ...)), close or sleep an engine, or lower max_model_len / "
                f"kv_cache_memory.")

    def _holdings(self, reclaimable: dict | None = None) -> str:
        with self._books_lock:
            items = list(self._bookings.items())
        if not items:
            return "nothing"
        parts = []
        for holder, booking in items:
            text = f"{holder.name}: weights {_mib(booking.weights_bytes)} + KV cache {_mib(booking.kv_cache_bytes)}"
            if reclaimable and reclaimable.get(holder):
                text += f" ({_mib(reclaimable[holder])} of it free)"
            parts.append(text)
        return "; ".join(parts)


# ---- the process's budgets -------------------------------------------------------------------

_budgets_lock = threading.Lock()
_budgets: dict[str, MemoryBudget] = {}


def get_memory_budget(device: str | torch.device) -> MemoryBudget:
    """The process's budget for ``device`` (made with the default size on first ask).

    >>> get_memory_budget("cpu").capacity_bytes
    """
    device = _normalize_device(device)
    with _budgets_lock:
        budget = _budgets.get(str(device))
        if budget is None:
            budget = MemoryBudget(device, _default_capacity(device))
            _budgets[str(device)] = budget
        return budget


def set_memory_budget(device: str | torch.device, bytes_or_fraction: int | float | str) -> MemoryBudget:
    """Set how much memory every engine in this process may hold on ``device``, together.

    >>> set_memory_budget("cuda:0", 0.5)        # half of the GPU
    >>> set_memory_budget("cpu", "4GiB")        # or 4 * 2**30

    ``bytes_or_fraction``: a float in (0, 1] is a fraction of the device's memory; an int or a
    string like ``"8GiB"`` is bytes. Engines already over a smaller budget give back free KV blocks
    first; if they cannot, :class:`MemoryBudgetError` is raised and nothing changes.
    """
    device = _normalize_device(device)
    capacity = _capacity_bytes(device, bytes_or_fraction)
    budget = get_memory_budget(device)
    budget.set_capacity(capacity)
    return budget


def memory_report() -> dict[str, dict]:
    """Every budget made so far and each engine's share, by device name.

    >>> memory_report()
    {'cpu': {'device': 'cpu', 'capacity_bytes': ..., 'reserved_bytes': ..., 'engines': [...]}}
    """
    with _budgets_lock:
        budgets = list(_budgets.values())
    return {str(budget.device): budget.report() for budget in budgets}


def _capacity_bytes(device: torch.device, value: int | float | str) -> int:
    from ..config import parse_bytes

    if isinstance(value, float):
        if not math.isfinite(value) or not 0 < value <= 1:
            raise ValueError(f"bytes_or_fraction as a float must be a fraction in (0, 1], got {value!r}; "
                             "pass bytes as an int or a str like '8GiB'")
        return int(device_memory_bytes(device) * value)
    return parse_bytes("bytes_or_fraction", value)


def _normalize_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from error
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {str(device)!r}")
    return device


def _default_capacity(device: torch.device) -> int:
    fraction = DEFAULT_GPU_FRACTION if device.type == "cuda" else DEFAULT_CPU_FRACTION
    return int(device_memory_bytes(device) * fraction)


def device_memory_bytes(device: torch.device) -> int:
    """A GPU's total memory; on the CPU, the RAM this process may use (a container's limit if lower)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_memory_limit()
    return min(total, limit) if limit else total


def _cgroup_memory_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 writes a huge number for "no limit"
            return int(text)
    return None


def _mib(num_bytes: int) -> str:
    """Bytes for a person: KiB, MiB or GiB, one decimal."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes / 2**10:.1f} KiB"
