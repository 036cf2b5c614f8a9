"""``AsyncLLM``: stream generations into coroutines while the model runs on the shared engine thread."""
from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from asyncio_throttle import Throttler

from .errors import EngineClosedError
from .lora.request import LoRARequest
from .registry import ChatPrompt, EngineCore, StreamOutput, get_engine
from .sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most ``max_requests`` new requests per ``period_s`` seconds, for each tenant.

    >>> RateLimit(max_requests=10, period_s=1.0)
    """

    max_requests: int
    period_s: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.max_requests, bool) or not isinstance(self.max_requests, int) or self.max_requests < 1:
            raise ValueError(f"max_requests must be a positive int, got {self.max_requests!r}")
        if isinstance(self.period_s, bool) or not isinstance(self.period_s, (int, float)) \
                or not math.isfinite(self.period_s) or self.period_s <= 0:
            raise ValueError(f"period_s must be a positive number of seconds, got {self.period_s!r}")


class TenantRateLimiter:
    """Per-tenant request rates: a request over its tenant's rate waits until the window has room.

    >>> limiter = TenantRateLimiter(RateLimit(10, 1.0), overrides={"batch-jobs": RateLimit(2, 1.0)})
    >>> await limiter.acquire("alice")

    Built on ``asyncio-throttle``; the limits hold exactly within one event loop.
    """

    def __init__(self, default: RateLimit, overrides: dict[str, RateLimit] | None = None):
        self.default = default
        self.overrides = dict(overrides or {})
        self._throttlers: dict[str, Throttler] = {}
        self._lock = threading.Lock()  # tenants may first appear on several threads at once

    async def acquire(self, tenant: str) -> None:
        await self._throttler_for(tenant).acquire()

    def _throttler_for(self, tenant: str) -> Throttler:
        with self._lock:
            throttler = self._throttlers.get(tenant)
            if throttler is None:
                limit = self.overrides.get(tenant, self.default)
                throttler = Throttler(rate_limit=limit.max_requests, period=limit.period_s)
                self._throttlers[tenant] = throttler
            return throttler


class AsyncLLM:
    """Generate from coroutines; the model runs on one background thread shared by every handle
    on the same model and config (``LLM``, ``ChatHearth``, other ``AsyncLLM``s).

    >>> from hearth_llm.engine import AsyncLLM, SamplingParams
    >>> engine = AsyncLLM("default")                      # cheap: the model loads on first use
    >>> async for out in engine.generate("The sky is", SamplingParams(temperature=0, max_tokens=16)):
    ...     print(out.delta_text, end="", flush=True)
    >>> messages = [{"role": "user", "content": "What is the capital of France?"}]
    >>> async for out in engine.chat(messages, SamplingParams(temperature=0, max_tokens=32), timeout=10):
    ...     if out.finished: print(out.finish_reason, out.usage)
    >>> await engine.abort(request_id)
    >>> engine.close()                                    # or: async with AsyncLLM(...) as engine:

    Keyword arguments are :class:`EngineConfig` fields, as for ``LLM``. Leaving an ``async for``
    early, cancelling the task or passing ``timeout`` aborts the request and frees its KV blocks.
    ``rate_limit=RateLimit(10, 1.0)`` (or a :class:`TenantRateLimiter`) throttles each ``tenant=``.
    Errors: :class:`EngineOverloadedError` when ``max_waiting_requests`` are waiting,
    :class:`RequestTimeoutError`, :class:`RequestFailedError`, :class:`EngineDeadError`.

    ``replicas=N, backend="ray"`` serves the model from N engines, each a Ray actor with its own KV
    cache (``pip install 'hearth-llm[ray]'``; :mod:`~.replicas`): requests go to the replica that holds
    their prompt's prefix, or the least-loaded one; a dead replica fails only its own requests
    (``EngineDeadError``). ``ray_address=`` joins a cluster; without it an initialised Ray is used,
    else a local one starts. ``LLM``, ``ChatHearth`` and ``HearthLLM`` take the same keywords.

    >>> engine = AsyncLLM("default", replicas=2, backend="ray")
    >>> engine.stats()["replicas"][1]["num_routed"]
    """

    def __init__(self, model: str = "default", *, rate_limit: RateLimit | TenantRateLimiter | None = None,
                 replicas: int = 1, backend: str = "local", ray_address: str | None = None,
                 **engine_kwargs) -> None:
        if isinstance(rate_limit, RateLimit):
            rate_limit = TenantRateLimiter(rate_limit)
        if rate_limit is not None and not isinstance(rate_limit, TenantRateLimiter):
            raise ValueError(f"rate_limit must be a RateLimit or a TenantRateLimiter, got {rate_limit!r}")
        self.rate_limiter = rate_limit
        self.core: EngineCore = get_engine(model, replicas=replicas, backend=backend, ray_address=ray_address,
                                           **engine_kwargs)
        self.core.attach()
        self._is_closed = False

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        *,
        timeout: float | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[StreamOutput]:
        """Stream the outputs of one prompt (text or token ids), one engine step at a time;
        ``lora_request`` picks a LoRA adapter (``enable_lora=True``), named on the last output."""
        if self._is_closed:
            raise EngineClosedError("this AsyncLLM was closed")
        if tenant is not None and self.rate_limiter is not None:
            await self.rate_limiter.acquire(tenant)
        stream = self.core.add_request(prompt, sampling_params, request_id, priority, cache_salt, timeout,
                                       lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def chat(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        *,
        timeout: float | None = None,
        tenant: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[StreamOutput]:
        """Render ``messages`` (offering ``tools``) with the model's chat template, then stream
        like :meth:`generate`."""
        prompt = ChatPrompt(messages, add_generation_prompt, chat_template_kwargs, tools)
        async for output in self.generate(prompt, sampling_params, request_id, priority, timeout=timeout,
                                          tenant=tenant, lora_request=lora_request):
            yield output

    async def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the engine's next step."""
        self.core.abort(request_id)

    def stats(self) -> dict:
        """Scheduler and KV cache counters as of the engine's last step, and its memory share."""
        return self.core.stats()

    async def sleep(self, level: int = 1) -> None:
        """Free the shared engine's memory once its running requests finish (level 1: the KV cache,
        weights to pinned host memory on a GPU; level 2: the weights too); the next request wakes it."""
        await asyncio.to_thread(self.core.sleep, level)

    async def wake_up(self) -> None:
        """Bring the weights and a fresh KV cache back now, instead of at the next request."""
        await asyncio.to_thread(self.core.wake_up)

    def close(self) -> None:
        """Release this handle; the shared engine stops when its last handle closes."""
        if not self._is_closed:
            self._is_closed = True
            self.core.detach()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()


__all__ = ["AsyncLLM", "RateLimit", "TenantRateLimiter"]
