"""``EngineReplica``: one engine inside a Ray actor (the class is plain Python; ``ray_cluster`` wraps
it with ``ray.remote`` when it starts replicas, so this module imports without Ray).

Outputs travel back multiplexed: the engine thread puts every request's outputs into one outbox
(its streams are :class:`_OutboxStream` objects, not readers' queues), and the driver's long-poll
(``poll``) takes everything there at once. One Ray call then carries a whole engine step's tokens
for every request on the replica, where a streaming generator per request would cost one Ray
object, and a wake-up of the actor's event loop, per token per request.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import sys
import threading
from dataclasses import dataclass

from ..config import EngineConfig
from ..engine_core import EngineCore
from ..model_info import ModelInfo

# How long one poll waits for news before it returns empty (the driver polls again at once).
POLL_WAIT_S = 1.0


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


class _Outbox:
    """Every request's outputs in arrival order, put by the engine thread, taken by ``poll``; the
    actor's event loop is woken once per batch, not once per output."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[str, object]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._has_items: asyncio.Event | None = None
        self._held = threading.local()  # the engine thread's posts of the step being dispatched

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is None:
            self._loop, self._has_items = loop, asyncio.Event()

    def post(self, request_id: str, item: object) -> None:
        """From any thread; inside :meth:`batched` (the engine thread's), held until it ends."""
        if isinstance(item, BaseException):
            item = _picklable(item)
        held = getattr(self._held, "items", None)
        if held is not None:
            held.append((request_id, item))
            return
        self._post_all([(request_id, item)])

    @contextlib.contextmanager
    def batched(self):
        """The posts of this thread inside the block reach the outbox together, so a poll takes a
        whole engine step's outputs or none of them."""
        self._held.items = []
        try:
            yield
        finally:
            items, self._held.items = self._held.items, None
            if items:
                self._post_all(items)

    def _post_all(self, items: list[tuple[str, object]]) -> None:
        with self._lock:
            was_empty = not self._items
            self._items.extend(items)
        if was_empty:
            self._loop.call_soon_threadsafe(self._has_items.set)

    async def take(self, wait_s: float) -> list[tuple[str, object]]:
        """Everything there; waits up to ``wait_s`` for the first item."""
        if not self._items:
            try:
                await asyncio.wait_for(self._has_items.wait(), wait_s)
            except asyncio.TimeoutError:
                return []
        self._has_items.clear()  # before taking: a post after this take sets it again
        with self._lock:
            items, self._items = self._items, []
        return items


class _OutboxStream:
    """What the replica's core puts a request's outputs into: its outbox, tagged with the request id.
    The driver's ``RequestStream`` has the reader, so it also keeps the deadline."""

    def __init__(self, request_id: str, outbox: _Outbox) -> None:
        self.request_id = request_id
        self._outbox = outbox

    def put(self, item) -> bool:
        self._outbox.post(self.request_id, item)
        return True  # the driver's reader leaving is an abort the driver sends


class _ReplicaCore(EngineCore):
    """An :class:`EngineCore` whose streams all lead into one outbox."""

    def __init__(self, config: EngineConfig, outbox: _Outbox) -> None:
        super().__init__(config)
        self._outbox = outbox

    def _make_stream(self, request_id: str, timeout: float | None) -> _OutboxStream:
        return _OutboxStream(request_id, self._outbox)

    def _dispatch(self, engine, deltas) -> bool:
        with self._outbox.batched():  # a step's outputs reach the outbox as one batch
            return super()._dispatch(engine, deltas)


class EngineReplica:
    """The body of one replica actor: an engine core and the outbox the driver polls.

    Every method is a coroutine, so Ray runs the actor as an async actor: a waiting ``poll`` does
    not block ``add`` or ``abort``.
    """

    def __init__(self, model: str, engine_kwargs: dict):
        self.config = EngineConfig.from_kwargs(model, **engine_kwargs)
        self._outbox = _Outbox()
        self.core = _ReplicaCore(self.config, self._outbox)

    async def start(self) -> ReplicaFacts:
        """Load the model (blocking only a worker thread) and describe it."""
        self._outbox.bind(asyncio.get_running_loop())
        await asyncio.to_thread(self.core.wait_until_started)
        engine = self.core.engine
        return ReplicaFacts(self.core.model_info, engine.tokenizer, engine.hf_config, self.config, os.getpid(),
                            _node_id())

    async def add(self, requests: list[tuple], cache_salt: str | None, timeout: float | None) -> None:
        """Queue ``(request_id, prompt, sampling_params, priority, lora_request)`` tuples as one
        batch; their outputs (or errors) appear in the outbox."""
        self._outbox.bind(asyncio.get_running_loop())
        try:
            self.core.add_requests([r[1] for r in requests], [r[2] for r in requests], [r[0] for r in requests],
                                   [r[3] for r in requests], cache_salt, timeout,
                                   lora_requests=[r[4] for r in requests])
        except Exception as error:  # noqa: BLE001 - overloaded or stopped: every request of the batch hears it
            for request in requests:
                self._outbox.post(request[0], error)

    async def poll(self, wait_s: float = POLL_WAIT_S) -> list[tuple[str, object]]:
        """Every ``(request_id, StreamOutput | exception)`` since the last poll, oldest first;
        waits up to ``wait_s`` for the first."""
        self._outbox.bind(asyncio.get_running_loop())
        return await self._outbox.take(wait_s)

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


def _picklable(error: BaseException) -> BaseException:
    """The error itself if it crosses Ray intact, else a RuntimeError with its text (a poll's reply
    that does not pickle would lose every output in it)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure: send the text instead
        return RuntimeError(f"{type(error).__name__}: {error}")


def _node_id() -> str:
    """The Ray node this actor runs on; "local" outside Ray (asking Ray there would start one)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "local"
    return ray.get_runtime_context().get_node_id()
