"""What one server serves and the limits it holds every request to.

>>> ServerSettings(model="default", api_keys=("sk-local",), max_tokens_limit=1024)
>>> ServerSettings(api_keys=[APIKey("sk-team-a", requests_per_minute=60, tokens_per_minute=40_000)])
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from hearth_llm.engine import RateLimit, TenantRateLimiter

from .quotas import APIKey

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_N = 8
# The bundled models' names in /v1/models (their files are named after the format, not the model).
_DEFAULT_NAMES = {"chat": "SmolLM2-135M-Instruct", "embedding": "all-MiniLM-L6-v2"}


@dataclass(slots=True)
class ServerSettings:
    """One server's models and limits.

    - ``model``: the chat model (``"default"``, a HF directory, a ``.gguf`` file or a hub id);
      ``served_model_name`` is its id in ``/v1/models`` (default: the model's name).
    - ``embedding_model``: the embedding model (default the bundled all-MiniLM-L6-v2); None serves none.
    - ``api_keys``: keys a client must send as ``Authorization: Bearer KEY`` (strings or
      :class:`APIKey` with requests/tokens per minute: past them 429); empty: no key needed.
    - ``max_body_bytes``, ``max_n``, ``max_tokens_limit`` (None: the model's context): caps on
      every request; past them a request is refused (413, 400, 400).
    - ``request_timeout``: seconds per request (None: none); a client's ``X-Request-Timeout``
      header may ask for less, never more.
    - ``rate_limit``: per-API-key request rate (the engine's :class:`TenantRateLimiter`); a request
      over its key's rate waits for room (the keys' own quotas refuse instead).
    - ``max_queued_requests``: while this many sequences wait for the engine (every user's, this
      server's or not), new requests are refused with 503 and ``Retry-After``; None: only the
      engine's own ``max_waiting_requests`` bound.
    - ``tracer_provider``: the OpenTelemetry ``TracerProvider`` of the per-request spans (None: the
      process's global one, a no-op until one is set).
    - ``preload``: load the models when the server starts, so the first request does not wait.
    - ``engine_kwargs``: :class:`EngineConfig` fields; the server shares its engine (and KV cache)
      with every ``LLM``, ``AsyncLLM`` and ``ChatHearth`` on the same model and config.
    """

    model: str = "default"
    served_model_name: str | None = None
    embedding_model: str | None = "default"
    api_keys: tuple[APIKey, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_n: int = DEFAULT_MAX_N
    max_tokens_limit: int | None = None
    request_timeout: float | None = None
    rate_limit: RateLimit | TenantRateLimiter | None = None
    max_queued_requests: int | None = None
    tracer_provider: object | None = None
    preload: bool = True
    engine_kwargs: dict = field(default_factory=dict)
    embedding_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.api_keys, (str, APIKey)):
            self.api_keys = (self.api_keys,)
        if not all(isinstance(key, APIKey) or (isinstance(key, str) and key) for key in self.api_keys):
            raise ValueError("api_keys must be non-empty strings or APIKey objects")
        self.api_keys = tuple(key if isinstance(key, APIKey) else APIKey(key) for key in self.api_keys)
        if len({key.key for key in self.api_keys}) < len(self.api_keys):
            raise ValueError("api_keys: a key is listed twice")
        if self.max_queued_requests is not None:
            _check_positive_int("max_queued_requests", self.max_queued_requests)
        _check_positive_int("max_body_bytes", self.max_body_bytes)
        _check_positive_int("max_n", self.max_n)
        if self.max_tokens_limit is not None:
            _check_positive_int("max_tokens_limit", self.max_tokens_limit)
        if self.request_timeout is not None and (isinstance(self.request_timeout, bool) or not isinstance(
                self.request_timeout, (int, float)) or not math.isfinite(self.request_timeout)
                                                  or self.request_timeout <= 0):
            raise ValueError(f"request_timeout must be a positive number of seconds or None, "
                             f"got {self.request_timeout!r}")
        if isinstance(self.rate_limit, RateLimit):
            self.rate_limit = TenantRateLimiter(self.rate_limit)
        if self.rate_limit is not None and not isinstance(self.rate_limit, TenantRateLimiter):
            raise ValueError(f"rate_limit must be a RateLimit, a TenantRateLimiter or None, got {self.rate_limit!r}")

    @property
    def chat_model_name(self) -> str:
        return self.served_model_name or model_name(self.model, "chat")

    @property
    def embedding_model_name(self) -> str | None:
        return None if self.embedding_model is None else model_name(self.embedding_model, "embedding")


def model_name(model: str, kind: str) -> str:
    """The id a model goes by in ``/v1/models``: the bundled model's name, a path's last part, a hub id."""
    if model == "default":
        return _DEFAULT_NAMES[kind]
    if os.path.exists(os.path.expanduser(model)):
        name = os.path.basename(os.path.normpath(os.path.expanduser(model)))
        return name.removesuffix(".gguf")
    return model


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
