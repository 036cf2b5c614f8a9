"""``EngineReplica``: one engine inside a Ray actor (the class is plain Python; ``ray_cluster`` wraps
it with ``ray.remote`` when it starts replicas, so this module imports without Ray).

Outputs travel back multiplexed: each request's stream is read by a task on the actor's event
loop into one outbox, and the driver's long-poll (``poll``) takes everything there at once. One
Ray call then carries a whole engine step's tokens for every request on the replica, where a
streaming generator per request would cost one Ray object per token per request.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from ..config import EngineConfig
from ..engine_core import EngineCore
from ..model_info import ModelInfo

# How long one poll waits for news before it returns empty (the driver polls again at once).
POLL_WAIT_S = 1.0
# Event-loop turns a poll lets pass after the first news, so the rest of that engine step's
# outputs (handed to the streams a moment apart) travel in the same reply.
COALESCE_TURNS = 3


@dataclass(frozen=True, slots=True)
class ReplicaFacts:
    """What the driver needs of a started replica: routing facts and the read-only model facts
    that ``LLM.engine`` / ``core.engine`` offer (the tokenizer travels pickled).

    Also what ``ReplicaSet.engine`` returns: ``.tokenizer``, ``.hf_config``, ``.max_model_len``."""

    model_info: ModelInfo
    tokenizer: object
    hf_config: object
    config: EngineConfig
    pid: int
    node_id: str

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model_info.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.model_info.eos_token_ids

    @property
    def lora_manager(self) -> None:
        return None  # adapters live in the replicas; per-request LoRARequest(path=...) still works


class EngineReplica:
    """The body of one replica actor: an :class:`EngineCore` and an outbox the driver polls.

    Every method is a coroutine, so Ray runs the actor as an async actor: a waiting ``poll`` does
    not block ``add`` or ``abort``.
    """

    def __init__(self, model: str, engine_kwargs: dict):
        self.config = EngineConfig.from_kwargs(model, **engine_kwargs)
        self.core = EngineCore(self.config)
        self._outbox: list[tuple[str, object]] = []
        self._has_news: asyncio.Event | None = None  # made on the actor's event loop
        self._readers: set[asyncio.Task] = set()

    async def start(self) -> ReplicaFacts:
        """Load the model (blocking only a worker thread) and describe it."""
        await asyncio.to_thread(self.core.wait_until_started)
        engine = self.core.engine
        return ReplicaFacts(self.core.model_info, engine.tokenizer, engine.hf_config, self.config, os.getpid(),
                            _node_id())

    async def add(self, requests: list[tuple], cache_salt: str | None, timeout: float | None) -> None:
        """Queue ``(request_id, prompt, sampling_params, priority, lora_request)`` tuples as one
        batch; their outputs (or errors) appear in the outbox."""
        request_ids = [request[0] for request in requests]
        try:
            streams = self.core.add_requests([r[1] for r in requests], [r[2] for r in requests], request_ids,
                                             [r[3] for r in requests], cache_salt, timeout,
                                             lora_requests=[r[4] for r in requests])
        except Exception as error:  # noqa: BLE001 - overloaded or stopped: every request of the batch hears it
            for request_id in request_ids:
                self._post(request_id, error)
            return
        for stream in streams:
            task = asyncio.get_running_loop().create_task(self._read(stream))
            self._readers.add(task)
            task.add_done_callback(self._readers.discard)

    async def poll(self, wait_s: float = POLL_WAIT_S) -> list[tuple[str, object]]:
        """Every ``(request_id, StreamOutput | exception)`` since the last poll, oldest first;
        waits up to ``wait_s`` for the first."""
        news = self._news()
        if not self._outbox:
            try:
                await asyncio.wait_for(news.wait(), wait_s)
            except asyncio.TimeoutError:
                return []
            for _ in range(COALESCE_TURNS):
                await asyncio.sleep(0)
        batch, self._outbox = self._outbox, []
        news.clear()
        return batch

    async def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    async def stats(self) -> dict:
        return self.core.stats()

    async def sleep(self, level: int) -> None:
        await asyncio.to_thread(self.core.sleep, level)

    async def wake_up(self) -> None:
        await asyncio.to_thread(self.core.wake_up)

    async def set_keep_alive(self, keep_alive: float | None, sleep_level: int | None) -> None:
        self.core.set_keep_alive(keep_alive, sleep_level)

    async def ping(self) -> int:
        return os.getpid()

    async def close(self) -> None:
        await asyncio.to_thread(self.core.close)

    # ---- the outbox ----------------------------------------------------------------------------

    async def _read(self, stream) -> None:
        try:
            async for output in stream:
                self._post(stream.request_id, output)
        except Exception as error:  # noqa: BLE001 - the driver's stream raises it
            self._post(stream.request_id, error)

    def _post(self, request_id: str, item: object) -> None:
        self._outbox.append((request_id, item))
        self._news().set()

    def _news(self) -> asyncio.Event:
        if self._has_news is None:
            self._has_news = asyncio.Event()
        return self._has_news


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray (tests of the body alone)
        return "local"
