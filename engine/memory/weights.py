"""A model's tensors, wherever its modules keep them: measured, and moved to host memory and back.

Modules keep weights as parameters and buffers, but linear methods also keep plain tensor
attributes (packed copies, tuples of quantized parts). Moving goes storage by storage, so tied
weights stay tied and views stay views of one copy.

>>> offloaded = offload_weights(model, pin_memory=True)   # every tensor now in (pinned) host memory
>>> offloaded.restore(torch.device("cuda"))               # back, same modules, same sharing
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(slots=True)
class _Slot:
    """Where one tensor sits: a module's parameter, buffer or attribute (``index`` into a list,
    tuple or dict attribute)."""

    owner: nn.Module
    kind: str            # "parameter", "buffer" or "attribute"
    name: str
    index: object = None
    tensor: torch.Tensor | None = None


def model_tensors(model: nn.Module) -> list[_Slot]:
    """Every place the model's modules hold a tensor (one tensor object may sit in several)."""
    slots = []
    for module in model.modules():
        slots += [_Slot(module, "parameter", name, tensor=p) for name, p in module._parameters.items()
                  if p is not None]
        slots += [_Slot(module, "buffer", name, tensor=b) for name, b in module._buffers.items() if b is not None]
        for name, value in vars(module).items():
            if name.startswith("_"):
                continue
            if isinstance(value, torch.Tensor):
                slots.append(_Slot(module, "attribute", name, tensor=value))
            elif isinstance(value, (list, tuple)):
                slots += [_Slot(module, "attribute", name, i, item) for i, item in enumerate(value)
                          if isinstance(item, torch.Tensor)]
            elif isinstance(value, dict):
                slots += [_Slot(module, "attribute", name, key, item) for key, item in value.items()
                          if isinstance(item, torch.Tensor)]
    return slots


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the model's tensors, each storage counted once (tied weights once)."""
    return sum(dict(_storage_key(slot.tensor) for slot in model_tensors(model)).values())


def _storage_key(tensor: torch.Tensor) -> tuple[object, int]:
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN blocked weights): no storage
        return id(tensor), tensor.numel() * tensor.element_size()


class OffloadedWeights:
    """The model's tensors moved to host memory by :func:`offload_weights`; :meth:`restore` moves
    them back to a device, into the same modules."""

    def __init__(self, slots: list[_Slot], device: torch.device, num_bytes: int) -> None:
        self.slots = slots
        self.device = device        # where they came from
        self.num_bytes = num_bytes

    def restore(self, device: torch.device | None = None) -> None:
        """Move every tensor to ``device`` (default: where it came from)."""
        _move(self.slots, device or self.device, pin_memory=False)


def offload_weights(model: nn.Module, device: torch.device | None = None, pin_memory: bool = True) -> OffloadedWeights:
    """Move the model's tensors on ``device`` (default: wherever they are) to host memory (pinned,
    for fast copies back to a GPU). Tensors elsewhere (a CPU-side table of a GPU model) stay."""
    slots = model_tensors(model)
    if device is None:
        devices = {slot.tensor.device for slot in slots}
        device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    slots = [slot for slot in slots if slot.tensor.device == device]
    num_bytes = sum(dict(_storage_key(slot.tensor) for slot in slots).values())
    _move(slots, torch.device("cpu"), pin_memory=pin_memory)
    return OffloadedWeights(slots, device, num_bytes)


@torch.no_grad()
def _move(slots: list[_Slot], device: torch.device, pin_memory: bool) -> None:
    """Copy each storage once to ``device``, then point every slot at its tensor's copy (same
    offset, size and stride). Nothing is re-pointed until every copy exists, so a failure (say,
    out of memory) changes nothing."""
    pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
    storage_copies: dict[tuple, torch.Tensor] = {}
    views: dict[int, torch.Tensor] = {}
    for slot in slots:
        tensor = slot.tensor
        if id(tensor) in views:
            continue
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key not in storage_copies:
            source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            target = torch.empty(storage.nbytes(), dtype=torch.uint8, device=device, pin_memory=pin)
            storage_copies[key] = target.copy_(source, non_blocking=True)
        views[id(tensor)] = torch.empty(0, dtype=tensor.dtype, device=device).set_(
            storage_copies[key].untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
    # The non-blocking copies must land before the sources go: wait on every GPU involved.
    for gpu in {d for key, copy in storage_copies.items() for d in (key[0], copy.device) if d.type == "cuda"}:
        torch.cuda.synchronize(gpu)
    for slot in slots:
        view = views[id(slot.tensor)]
        _put(slot, view)
        slot.tensor = slot.owner._parameters[slot.name] if slot.kind == "parameter" else view


def _put(slot: _Slot, tensor: torch.Tensor) -> None:
    if slot.kind == "parameter":
        slot.owner._parameters[slot.name].data = tensor  # the same Parameter object: tied layers follow
    elif slot.kind == "buffer":
        slot.owner._buffers[slot.name] = tensor
    elif slot.index is None:
        object.__setattr__(slot.owner, slot.name, tensor)
    else:
        container = getattr(slot.owner, slot.name)
        if isinstance(container, tuple):
            items = list(container)
            items[slot.index] = tensor
            rebuilt = tuple(items) if type(container) is tuple else type(container)(*items)  # a namedtuple
            object.__setattr__(slot.owner, slot.name, rebuilt)
        else:
            container[slot.index] = tensor
