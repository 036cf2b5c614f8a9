"""What the endpoints share: the settings, the chat engine and its chat service, the embedding
engine, and the per-request rules that every endpoint applies the same way (which model a name
means, the timeout, the queue bound, the key's quotas and rate limit)."""
from __future__ import annotations

import asyncio
import math
import time

from fastapi import Request

from hearth_llm.embeddings import EmbeddingEngine, get_embedding_engine
from hearth_llm.engine import EngineCore, get_engine
from hearth_llm.engine.chat import ChatService

from .errors import RETRY_AFTER_S, APIError
from .quotas import KeyQuotas, QuotaExceededError
from .settings import ServerSettings

TIMEOUT_HEADER = "x-request-timeout"


class ServerState:
    """The server's engines and rules; one per app, at ``app.state.hearth``."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.core: EngineCore = get_engine(settings.model, **{"show_progress": False, **settings.engine_kwargs})
        self.chat_service = ChatService(self.core)
        self.embedding_engine: EmbeddingEngine | None = None
        if settings.embedding_model is not None:
            self.embedding_engine = get_embedding_engine(
                settings.embedding_model, **{"show_progress": False, **settings.embedding_kwargs})
        # tenants are keys by position (what the middleware puts in request.state.tenant)
        self.quotas = KeyQuotas({f"key-{index}": key for index, key in enumerate(settings.api_keys)})
        self.created = int(time.time())
        self._is_attached = False

    async def start(self) -> None:
        """Hold the chat engine for the server's life; load the models unless ``preload`` is off."""
        self.core.attach()
        self._is_attached = True
        if self.settings.preload:
            await asyncio.to_thread(self.core.wait_until_started)
            if self.embedding_engine is not None:
                await asyncio.to_thread(self.embedding_engine.start)

    def stop(self) -> None:
        """Release the chat engine (it stops if nothing else holds it)."""
        if self._is_attached:
            self._is_attached = False
            self.core.detach()

    # ---- per-request rules ---------------------------------------------------------------------

    def check_chat_model(self, name: str) -> None:
        self._check_model(name, self.settings.chat_model_name, self.settings.model, "chat")

    def check_embedding_model(self, name: str) -> EmbeddingEngine:
        if self.embedding_engine is None:
            raise APIError(404, "this server serves no embedding model", param="model", code="model_not_found")
        self._check_model(name, self.settings.embedding_model_name, self.settings.embedding_model, "embedding")
        return self.embedding_engine

    def _check_model(self, name: str, served_name: str, model: str, kind: str) -> None:
        if name not in ("default", served_name, model):
            raise APIError(404, f"model {name!r} is not served here; the {kind} model is {served_name!r} "
                                f"(or say 'default')", param="model", code="model_not_found")

    def timeout(self, request: Request) -> float | None:
        """The server's ``request_timeout``, or less when the client's ``X-Request-Timeout`` asks for less."""
        limit = self.settings.request_timeout
        header = request.headers.get(TIMEOUT_HEADER)
        if header is None:
            return limit
        try:
            asked = float(header)
        except ValueError:
            asked = math.nan
        if not math.isfinite(asked) or asked <= 0:
            raise APIError(400, f"the X-Request-Timeout header must be a positive number of seconds, got {header!r}",
                           param="X-Request-Timeout")
        return asked if limit is None else min(asked, limit)

    async def admit(self, request: Request, *, uses_chat_engine: bool = True) -> None:
        """Let a request on, or refuse it before it reaches an engine: 503 while the chat engine's
        queue is at ``max_queued_requests``, 429 when its key is over a quota; then wait until
        the key is within its ``rate_limit``. The quota headers go out with the response."""
        if uses_chat_engine:
            await self._check_queue()
        try:
            request.state.response_headers = self.quotas.admit(request.state.tenant)
        except QuotaExceededError as error:
            raise APIError(429, str(error), code="rate_limit_exceeded", error_type=error.kind,
                           headers=error.headers) from None
        if self.settings.rate_limit is not None:
            await self.settings.rate_limit.acquire(request.state.tenant)

    @property
    def adds_can_block(self) -> bool:
        """A child-process core answers an add over its pipe, between two of its engine steps."""
        return self.core.config.engine_core == "process"

    async def add_requests(self, prompts: list, *args, **kwargs) -> list:
        """``core.add_requests``, off the event loop where it can block (:attr:`adds_can_block`, or
        text prompts, tokenized in the call): every other stream on the loop would wait meanwhile."""
        if not self.adds_can_block and not any(isinstance(p, str) for p in prompts):
            return self.core.add_requests(prompts, *args, **kwargs)
        return await off_the_loop(lambda: self.core.add_requests(prompts, *args, **kwargs), _close_streams)

    def charge(self, request: Request, num_tokens: int, usage=None) -> None:
        """Count a request's tokens (prompt + completion) against its key's tokens per minute;
        its ``usage`` (when it finished) goes to the log line and the span."""
        self.quotas.charge(request.state.tenant, num_tokens)
        if usage is not None:
            request.state.log.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)

    async def _check_queue(self) -> None:
        bound = self.settings.max_queued_requests
        if bound is None:
            return
        # waiting as of the engine's last step, plus requests added since; a child-process core
        # answers over its pipe (between two of its steps), so not on the event loop
        stats = await asyncio.to_thread(self.core.stats) if self.adds_can_block else self.core.stats()
        num_waiting = stats.get("num_waiting", 0) + stats.get("num_queued", 0)
        if num_waiting >= bound:
            raise APIError(503, f"{num_waiting} sequences are waiting for the engine, this server's "
                                f"max_queued_requests={bound}; retry later", code="engine_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def max_tokens(self, asked: int | None, field: str = "max_tokens") -> int | None:
        """``asked`` within ``max_tokens_limit``; a request that names none gets the limit."""
        limit = self.settings.max_tokens_limit
        if asked is not None and asked < 1:
            raise APIError(400, f"{field} must be >= 1, got {asked}", param=field)
        if asked is not None and limit is not None and asked > limit:
            raise APIError(400, f"{field} must be at most {limit} on this server, got {asked}", param=field)
        return asked if asked is not None else limit

    def check_n(self, n: int | None) -> int:
        n = 1 if n is None else n
        if n < 1 or n > self.settings.max_n:
            raise APIError(400, f"n must be in [1, {self.settings.max_n}] on this server, got {n}", param="n")
        return n


async def off_the_loop(submit, close):
    """``submit()`` on a worker thread; if the awaiting request is cancelled meanwhile (its client
    left), ``close(result)`` runs once ``submit`` returns, so what it queued is aborted, not leaked."""
    future = asyncio.get_running_loop().run_in_executor(None, submit)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda done: done.cancelled() or done.exception() or close(done.result()))
        raise


def _close_streams(streams: list) -> None:
    for stream in streams:
        stream.close()
