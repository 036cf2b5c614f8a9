"""The engine core in a child process (``engine_core="process"``): :class:`ProcessEngineCore` in this
process (:mod:`.client`), a plain ``EngineCore`` in the child (:mod:`.child`), messages between them
(:mod:`.messages`)."""
from __future__ import annotations

from .client import ProcessEngineCore
from .messages import EngineView

__all__ = ["ProcessEngineCore", "EngineView"]
