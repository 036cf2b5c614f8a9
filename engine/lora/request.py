"""Which LoRA adapter a request runs with."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT LoRA adapter by name, with the directory to load it from.

    ``path`` may be left out for a name the engine already knows (``llm.add_lora`` or an earlier
    request with a path). The name is what outputs and usage report as the adapter that answered.

    >>> llm.generate(["SELECT"], params, lora_request=LoRARequest("sql", "/adapters/sql-lora"))
    >>> llm.generate(["SELECT"], params, lora_request=LoRARequest("sql"))   # known by now
    """

    name: str
    path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LoRARequest name must be a non-empty str, got {self.name!r}")
        if self.path is not None:
            if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
                raise ValueError(f"LoRARequest {self.name!r}: path must be a non-empty str or path, got {self.path!r}")
            object.__setattr__(self, "path", str(self.path))


def as_lora_request(value) -> LoRARequest | None:
    """``None``, a :class:`LoRARequest`, or a str: a directory that exists (named by its path) or
    the name of an adapter the engine knows. What integrations accept as ``lora=``.

    >>> as_lora_request("sql")
    LoRARequest(name='sql', path=None)
    """
    if value is None or isinstance(value, LoRARequest):
        return value
    if isinstance(value, (str, os.PathLike)) and str(value):
        text = str(value)
        return LoRARequest(text, text) if os.path.isdir(text) else LoRARequest(text)
    raise ValueError(f"lora must be an adapter name, a PEFT adapter directory or a LoRARequest, got {value!r}")
