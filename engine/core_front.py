"""The caller's side that every engine core shares: requests in, outputs back, handles.

Three cores serve ``LLM`` and ``AsyncLLM`` behind one interface: :class:`~.engine_core.EngineCore`
(the engine on a thread), :class:`~.core_process.client.ProcessEngineCore` (in a child process) and
:class:`~.replicas.replica_set.ReplicaSet` (on Ray replicas). Each queues a batch its own way, but
what happens on the caller's thread before that is written once, here:

- :func:`check_requests` checks ``add_requests``' arguments (lengths, ``timeout``, each request's
  sampling parameters, priority, id and LoRA request) and changes nothing: a bad argument raises a
  ``ValueError`` / ``TypeError`` naming it, before any stream exists or anything is queued;
- :class:`CoreFront` gives a core ``add_request`` (one prompt of ``add_requests``), the
  ``attach``/``detach`` handle count, ``_raise_if_stopped`` and the stream a request's outputs go to;
- :func:`deliver` hands an output that came back (over a pipe, from a replica's outbox) to its
  stream, and aborts the request when its reader has gone.

>>> [checked] = check_requests(["Hello"], [SamplingParams(max_tokens=8)], timeout=30)
>>> checked.sampling_params.max_tokens
8
>>> check_requests(["Hello"], [None], timeout=0)
Traceback (most recent call last):
ValueError: timeout must be a positive number of seconds or None, got 0
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable

from .errors import EngineClosedError, EngineDeadError
from .input_processor import RequestInput, request_input
from .outputs import StreamOutput
from .streams import RequestStream


def check_timeout(timeout: float | None) -> None:
    """``timeout`` is None or a positive, finite number of seconds; else ``ValueError`` naming it."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")


def check_requests(prompts: list, sampling_params: list, request_ids: list | None = None,
                   priorities: list | None = None, cache_salt: str | None = None, timeout: float | None = None,
                   lora_requests: list | None = None) -> list[RequestInput]:
    """``add_requests``' arguments, checked on the caller's thread (the prompts themselves are
    checked where the tokenizer is); one :class:`RequestInput` per prompt, ids fixed. Raises
    before anything changes, so a refused batch leaves the engine serving as before."""
    count = len(prompts)
    request_ids = list(request_ids) if request_ids is not None else [None] * count
    priorities = list(priorities) if priorities is not None else [0] * count
    lora_requests = list(lora_requests) if lora_requests is not None else [None] * count
    if not (len(sampling_params) == len(request_ids) == len(priorities) == len(lora_requests) == count):
        raise ValueError(f"add_requests got {count} prompts but {len(sampling_params)} sampling_params, "
                         f"{len(request_ids)} request_ids, {len(priorities)} priorities and "
                         f"{len(lora_requests)} lora_requests")
    check_timeout(timeout)
    return [request_input(prompt, params, request_id, priority, cache_salt, lora)
            for prompt, params, request_id, priority, lora in zip(prompts, sampling_params, request_ids,
                                                                  priorities, lora_requests)]


def is_last_item(item: StreamOutput | BaseException) -> bool:
    """A stream's last item: an error, or the request's finished output."""
    return isinstance(item, BaseException) or (isinstance(item, StreamOutput) and item.finished)


def deliver(stream, item: StreamOutput | BaseException, abort: Callable) -> None:
    """Hand ``item`` to ``stream``; a reader gone before the last item (its event loop closed)
    means the request is no longer wanted: ``abort(stream)`` frees it."""
    if not stream.put(item) and not is_last_item(item):
        abort(stream)


class CoreFront:
    """The methods every engine core has in common. A core that uses it sets ``config``,
    ``_lock`` (a ``threading.Lock``), ``_num_handles = 0``, ``_is_closing``, ``_stop_error``, and
    defines ``start``, ``engine``, ``add_requests``, ``close``, ``_abort_stream(stream)`` and
    ``_is_serving()``; for ``wait_until_started`` also ``_started`` (a ``threading.Event`` set once
    loaded or failed) and ``_startup_error`` (or it defines its own).

    >>> core = get_engine("default")
    >>> core.attach()                         # a handle keeps it running
    >>> stream = core.add_request("Hello", SamplingParams(max_tokens=8))
    >>> core.detach()                         # the last handle closes it
    """

    config: object
    _lock: threading.Lock
    _started: threading.Event
    _startup_error: BaseException | None
    _num_handles: int
    _is_closing: bool
    _stop_error: EngineDeadError | None

    def wait_until_started(self, timeout: float | None = None) -> None:
        """Start and block until the model is loaded; raises what loading raised."""
        self.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"the engine for model {self.config.model!r} did not start within {timeout} s")
        if self._startup_error is not None:
            raise self._startup_error
        self._raise_if_stopped()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_stopped(self) -> bool:
        return self._is_closing or self._stop_error is not None

    def add_request(self, prompt, sampling_params=None, request_id: str | None = None, priority: int = 0,
                    cache_salt: str | None = None, timeout: float | None = None,
                    lora_request=None) -> RequestStream:
        """Queue a request; returns its stream at once. Invalid sampling parameters raise here,
        invalid prompts when the stream is read. Raises :class:`EngineOverloadedError` when
        ``max_waiting_requests`` sequences are already waiting."""
        return self.add_requests([prompt], [sampling_params], [request_id], [priority], cache_salt, timeout,
                                 lora_requests=[lora_request])[0]

    def attach(self) -> None:
        """Count one more handle that keeps this engine running."""
        with self._lock:
            self._raise_if_stopped()
            self._num_handles += 1

    def detach(self) -> None:
        """Release a handle; the last one closes the engine."""
        with self._lock:
            self._num_handles = max(0, self._num_handles - 1)
            is_last = self._num_handles == 0
        if is_last:
            self.close()

    def _raise_if_stopped(self) -> None:
        if self._stop_error is not None:
            raise error_like(self._stop_error)
        if self._is_closing:
            raise EngineClosedError("the engine was closed")

    def _make_stream(self, request_id: str, timeout: float | None) -> RequestStream:
        """The stream a request's outputs go to, read by ``LLM``/``AsyncLLM`` (a child-process or
        replica engine overrides it to send them back instead)."""
        return RequestStream(request_id, timeout, abort=self._abort_stream, is_engine_alive=self._is_serving,
                             model=str(self.config.model))


def error_like(error: EngineDeadError) -> EngineDeadError:
    """A fresh copy per raise site, so tracebacks do not pile up on one shared instance."""
    copy = type(error)(*error.args)
    copy.__cause__ = error.__cause__
    return copy
