"""A per-thread cache of values computed from one step's metadata, for the CPU routines.

On a CPU a small model's decode step is hundreds of tiny ops, so the masks, gather indices and
rotary tables that depend only on the step's metadata are built once per step, not once per layer.
"""
from __future__ import annotations

import threading

import torch


class StepMemo:
    """Caches a value computed from a few small tensors until the tensors change.

    Every layer of a step passes the same metadata, so one computation serves the whole step. A
    tensor in the key matches by identity and version counter when it has one; tensors made under
    ``torch.inference_mode()`` have none, so they match by content (the metadata is small).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, name: str, key: tuple, compute):
        """``compute()``, or its value from the last call with an equal ``key``."""
        entries = self._local.__dict__.setdefault("entries", {})
        entry = entries.get(name)
        if entry is not None and _matches(entry[0], key):
            return entry[1]
        value = compute()
        entries[name] = (tuple(_snapshot(item) for item in key), value)
        return value


def _snapshot(item):
    if not isinstance(item, torch.Tensor):
        return ("value", item)
    if item.is_inference():
        return ("content", item.clone())
    return ("identity", item, item._version)


def _matches(snapshots: tuple, key: tuple) -> bool:
    for snapshot, item in zip(snapshots, key):
        kind = snapshot[0]
        if kind == "value":
            if isinstance(item, torch.Tensor) or snapshot[1] != item:
                return False
        elif not isinstance(item, torch.Tensor):
            return False
        elif kind == "content":
            if not item.is_inference() or not torch.equal(snapshot[1], item):
                return False
        elif snapshot[1] is not item or snapshot[2] != item._version:
            return False
    return True


# One memo for all CPU routines: every layer of a step asks it with the same metadata.
memo = StepMemo()
