"""``RequestStream``: the outputs of one request, handed from the engine thread to any reader."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

from .errors import EngineDeadError, RequestTimeoutError
from .outputs import StreamOutput

if TYPE_CHECKING:
    from .engine_core import EngineCore

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
    """

    def __init__(self, core: EngineCore, request_id: str, timeout: float | None):
        self.request_id = request_id
        self._core = core
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._lock = threading.Lock()
        self._items: deque[StreamOutput | BaseException] = deque()
        self._waiter: threading.Event | tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self._is_done = False  # the consumer saw the last output or an error, or gave up

    # ---- engine thread side ----------------------------------------------------------------

    def put(self, item: StreamOutput | BaseException) -> bool:
        """Hand over an output or an error; False when the reader's event loop is gone."""
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is None:
            return True
        if isinstance(waiter, threading.Event):
            waiter.set()
            return True
        loop, future = waiter
        try:
            loop.call_soon_threadsafe(_resolve, future)
        except RuntimeError:  # the loop is closed: nobody will read this stream
            return False
        return True

    # ---- consumer side ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[StreamOutput]:
        try:
            while True:
                item, waiter = self._take_or_wait(threading.Event)
                if waiter is not None:
                    waiter.wait(self._wait_s())
                    self._check_progress()
                    continue
                output = self._unwrap(item)
                yield output
                if output.finished:
                    return
        finally:
            self.close()

    async def __aiter__(self) -> AsyncIterator[StreamOutput]:
        loop = asyncio.get_running_loop()
        try:
            while True:
                item, waiter = self._take_or_wait(lambda: (loop, loop.create_future()))
                if waiter is not None:
                    await asyncio.wait((waiter[1],), timeout=self._wait_s())
                    self._check_progress()
                    continue
                output = self._unwrap(item)
                yield output
                if output.finished:
                    return
        finally:
            self.close()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading; aborts the request unless it already finished."""
        if not self._is_done:
            self._is_done = True
            self._core._abort_stream(self)

    def _take_or_wait(self, make_waiter: Callable):
        with self._lock:
            if self._items:
                return self._items.popleft(), None
            self._waiter = make_waiter()
            return None, self._waiter

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
        if not self._core._is_thread_alive():
            with self._lock:
                if self._items:
                    return  # the last words of the engine thread are still to be read
            raise EngineDeadError(f"the engine thread for model {self._core.config.model!r} is gone")

    def _check_deadline(self) -> None:
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise RequestTimeoutError(
                f"request {self.request_id!r} did not finish within timeout={self._timeout} s; it was aborted")


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
