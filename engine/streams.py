"""``RequestStream``: the outputs of one request, handed from the engine thread to any reader.

The stream knows nothing of the engine: it is given a callback that aborts its request and one
that says whether the engine thread still lives, so the two modules do not import each other.
"""
from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from .errors import EngineDeadError, RequestTimeoutError
from .outputs import StreamOutput

# A reader that waits re-checks this often that the engine thread still lives, so nothing hangs.
LIVENESS_POLL_S = 1.0


class RequestStream:
    """The outputs of one request, read by one consumer from any thread (``for``) or event loop
    (``async for``).

    Leaving the loop early, cancelling the reading task, or passing ``timeout`` aborts the request,
    which frees its KV blocks before the engine's next step. Errors arrive as exceptions:
    ``ValueError`` for invalid input, :class:`RequestFailedError`, :class:`RequestTimeoutError`,
    :class:`EngineDeadError`.

    >>> with get_engine("default").add_request("Hello", SamplingParams(max_tokens=8)) as stream:
    ...     for out in stream:
    ...         print(out.delta_text, end="")

    ``abort`` is called once with the stream when its reader stops early; ``is_engine_alive`` is
    asked whenever a reader has waited ``LIVENESS_POLL_S`` without news; ``model`` names the engine
    in the error raised when it is gone.
    """

    def __init__(self, request_id: str, timeout: float | None, *, abort: Callable[[RequestStream], None],
                 is_engine_alive: Callable[[], bool], model: str = ""):
        self.request_id = request_id
        self._abort = abort
        self._is_engine_alive = is_engine_alive
        self._model = model
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._lock = threading.Lock()
        self._items: deque[StreamOutput | BaseException] = deque()
        self._waiter: _ThreadWaiter | _LoopWaiter | None = None
        self._is_done = False  # the consumer saw the last output or an error, or gave up

    # ---- engine thread side ----------------------------------------------------------------

    def put(self, item: StreamOutput | BaseException) -> bool:
        """Hand over an output or an error; False when the reader's event loop is gone."""
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        return waiter is None or waiter.wake()

    # ---- consumer side ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[StreamOutput]:
        with self:
            for step in self._read(_ThreadWaiter):
                if isinstance(step, StreamOutput):
                    yield step
                else:
                    step.wait(self._wait_s())

    async def __aiter__(self) -> AsyncIterator[StreamOutput]:
        waker = _loop_waker()
        with self:
            for step in self._read(lambda: _LoopWaiter(waker)):
                if isinstance(step, StreamOutput):
                    yield step
                else:
                    await step.wait(self._wait_s())

    async def batches(self) -> AsyncIterator[list[StreamOutput]]:
        """As ``async for``, but the outputs that arrived while the reader was busy come as one
        list: a server that fell behind the engine sends them as one event and so catches up,
        instead of paying a wake-up and an event per token.

        >>> async for outputs in stream.batches():
        ...     send("".join(out.delta_text for out in outputs))
        """
        waker = _loop_waker()
        with self:
            while True:
                with self._lock:
                    items = list(self._items)
                    self._items.clear()
                    if not items:
                        self._waiter = waiter = _LoopWaiter(waker)
                if not items:
                    await waiter.wait(self._wait_s())
                    self._check_progress()
                    continue
                batch = self._unwrap_batch(items)
                if batch:
                    yield batch
                    if batch[-1].finished:
                        return

    def _unwrap_batch(self, items: list[StreamOutput | BaseException]) -> list[StreamOutput]:
        """``items`` unwrapped up to an error; the error goes back to the front of the queue (so it
        is raised after the outputs before it were handed over) or is raised now, with none before it."""
        batch = []
        for position, item in enumerate(items):
            if isinstance(item, BaseException) and batch:
                with self._lock:
                    self._items.extendleft(reversed(items[position:]))
                return batch
            output = self._unwrap(item)
            batch.append(output)
            if output.finished:
                return batch
        return batch

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading; aborts the request unless it already finished."""
        if not self._is_done:
            self._is_done = True
            self._abort(self)

    def _read(self, make_waiter: Callable) -> Iterator[StreamOutput | _ThreadWaiter | _LoopWaiter]:
        """The reading loop, written once for both iterators: yields each output up to the last,
        or, when none is there, a waiter for the caller to wait on (``put`` wakes it)."""
        while True:
            with self._lock:
                item = self._items.popleft() if self._items else None
                if item is None:
                    self._waiter = waiter = make_waiter()
            if item is None:
                yield waiter
                self._check_progress()
                continue
            output = self._unwrap(item)
            yield output
            if output.finished:
                return

    def _unwrap(self, item: StreamOutput | BaseException) -> StreamOutput:
        if isinstance(item, BaseException):
            self._is_done = True  # the engine already dropped the request
            raise item
        if item.finished:
            self._is_done = True
        else:
            self._check_deadline()
        return item

    def _wait_s(self) -> float:
        if self._deadline is None:
            return LIVENESS_POLL_S
        return max(0.0, min(LIVENESS_POLL_S, self._deadline - time.monotonic()))

    def _check_progress(self) -> None:
        self._check_deadline()
        if not self._is_engine_alive():
            with self._lock:
                if self._items:
                    return  # the last words of the engine thread are still to be read
            raise EngineDeadError(f"the engine thread for model {self._model!r} is gone")

    def _check_deadline(self) -> None:
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise RequestTimeoutError(
                f"request {self.request_id!r} did not finish within timeout={self._timeout} s; it was aborted")


class _ThreadWaiter(threading.Event):
    """A reading thread waits on it; ``put`` sets it."""

    def wake(self) -> bool:
        self.set()
        return True


class _LoopWaiter:
    """A reading coroutine awaits its future; ``put`` resolves it on the reader's event loop."""

    def __init__(self, waker: _LoopWaker):
        self.waker = waker
        self.future = waker.loop.create_future()

    def wake(self) -> bool:
        return self.waker.wake(self.future)

    async def wait(self, timeout: float) -> None:
        """Until woken or ``timeout`` seconds (a timer resolves the same future: cheaper per token
        than ``asyncio.wait``, which builds a set, a waiter future and callbacks each time)."""
        timer = self.waker.loop.call_later(timeout, _resolve, self.future)
        try:
            await self.future
        finally:
            timer.cancel()


class _LoopWaker:
    """One per event loop: the engine thread's wake-ups of that loop's readers, delivered by one
    callback per burst. A step's outputs for 256 streams then cost one ``call_soon_threadsafe``
    (a self-pipe write and a loop wake-up), not 256."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[asyncio.Future] = []
        self._is_loop_closed = False

    def wake(self, future: asyncio.Future) -> bool:
        """Resolve ``future`` on the loop soon; False when the loop is closed (nobody will read)."""
        with self._lock:
            if self._is_loop_closed:
                return False
            self._pending.append(future)
            if len(self._pending) > 1:
                return True  # a flush is scheduled already and has not run yet
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._is_loop_closed = True
                self._pending.clear()
            return False
        return True

    def _flush(self) -> None:
        with self._lock:
            futures, self._pending = self._pending, []
        for future in futures:
            _resolve(future)


_WAKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker] = weakref.WeakKeyDictionary()


def _loop_waker() -> _LoopWaker:
    """The running loop's waker (made on first use, on the loop's own thread)."""
    loop = asyncio.get_running_loop()
    waker = _WAKERS.get(loop)
    if waker is None:
        waker = _WAKERS[loop] = _LoopWaker(loop)
    return waker


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
