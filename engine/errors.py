"""What the shared engine raises when a request cannot be served, each cause its own type."""
from __future__ import annotations


class EngineError(RuntimeError):
    """Base class of the errors below."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full (``max_waiting_requests``); retry later or raise the bound."""


class EngineDeadError(EngineError):
    """The engine loop has stopped (it crashed or failed to start); no request on it can be served.

    ``__cause__`` holds the original exception when there is one. To restart, build a new handle
    for the same model (``AsyncLLM(model)``, ``LLM(model)``, ``ChatHearth(model=...)``, or
    ``get_engine(model)``): the registry replaces a stopped engine with a fresh one, which loads
    the model again. Handles made before the crash keep raising this error.

    >>> try:
    ...     text = await llm.generate(prompt)
    ... except EngineDeadError:
    ...     llm = AsyncLLM(model)      # a fresh engine; retry the request on it
    """


class EngineClosedError(EngineDeadError):
    """The engine was closed (``close()``, a context manager's exit, or interpreter exit)."""


class RequestFailedError(EngineError):
    """This request failed (its forward pass or detokenization raised); the engine keeps serving.

    ``__cause__`` holds the original exception.
    """


class RequestTimeoutError(EngineError, TimeoutError):
    """The request ran past its ``timeout``; it was aborted and its KV blocks freed."""
