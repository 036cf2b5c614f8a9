"""``ProcessEngineCore``: :class:`~..engine_core.EngineCore`'s interface, with the engine in a child process.

Why a process: torch's OpenMP runtime (libgomp) is one per process. Once two threads of a process
have each run parallel torch work (a notebook's tensors on the main thread, our engine on its
own), libgomp stops its idle threads from spinning, and every one of a decode step's ~150 short
parallel regions then pays a sleep and a wake-up. In a child process the engine has libgomp to
itself, whatever the caller's thread does, and the caller's torch keeps its own too.

The parent keeps only streams: each request is checked here (the same errors, raised on the
caller's thread), sent to the child (see :mod:`.child`), and its outputs come back over the pipe
to an ordinary :class:`~..streams.RequestStream`, read by ``LLM``, ``AsyncLLM`` and the integrations
as before. A child that dies fails every pending request with :class:`EngineDeadError` at once;
closing the last handle (or interpreter exit) stops and reaps it, and the child leaves by itself
when this process goes away (its pipe closes).

>>> llm = LLM("default", engine_core="process")
>>> llm.generate("Hello")[0].outputs[0].text

Not the default: ``LLM.engine`` is only a read-only :class:`~.messages.EngineView` here, LoRA and
tensor parallelism need the in-thread core, and the first start pays the forkserver's imports.
On the busy 2-core machine it was measured on (load 6-12, ``hearth-llm bench cpu --interference``)
it did not beat the in-thread core: a spinning OpenMP team loses there (see that benchmark).
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass, field, replace
from multiprocessing import connection

from ..config import EngineConfig, parse_seconds
from ..core_front import CoreFront, check_requests, check_timeout, deliver, error_like, is_last_item
from ..errors import EngineClosedError, EngineDeadError
from ..executor.multiproc import _main_module_hidden, _process_context
from ..memory.sleep import check_sleep_level
from ..streams import RequestStream
from .child import core_process_main
from .messages import (Abort, AddRequests, Call, Close, EngineView, Output, Outputs, Reply, Started, Stopped,
                       expanded)

logger = logging.getLogger("hearth_llm")

# The engine process answers a call between two steps at the latest; past this, it is stuck.
CALL_TIMEOUT_S = 600.0
CLOSE_TIMEOUT_S = 30.0


def _engine_log_level() -> int | None:
    """The level from which this process shows the engine's log lines (what the child should
    print itself), or None when no handler here would show them."""
    engine_logger = logging.getLogger("hearth_llm")
    level = engine_logger.getEffectiveLevel()
    shown = engine_logger
    while shown is not None:
        if any(handler.level <= level for handler in shown.handlers):  # (NOTSET is 0: shows all)
            return level
        shown = shown.parent if shown.propagate else None
    return None


@dataclass(slots=True, eq=False)
class _PendingCall:
    done: threading.Event = field(default_factory=threading.Event)
    value: object = None
    error: BaseException | None = None


class ProcessEngineCore(CoreFront):
    """One model's engine in a child process, behind :class:`EngineCore`'s methods: ``get_engine``
    returns one for ``engine_core="process"``; handles use it as they use the in-thread core.

    >>> core = get_engine("default", engine_core="process")    # cheap: the process starts on first use
    >>> stream = core.add_request("Hello", SamplingParams(temperature=0, max_tokens=8))
    >>> "".join(out.delta_text for out in stream)
    >>> core.engine.pid                                        # the child; core.engine is read-only
    """

    def __init__(self, config: EngineConfig, on_stop=None) -> None:
        self.config = config
        self._on_stop = on_stop
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._process = None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._started = threading.Event()
        self._startup_error: BaseException | None = None
        self._stop_error: EngineDeadError | None = None
        self._is_closing = False
        self._num_handles = 0
        self._view: EngineView | None = None
        self._model_info = None
        self._stats: dict = {}
        self._streams: dict[int, RequestStream] = {}
        self._calls: dict[int, _PendingCall] = {}
        self._ids = itertools.count()
        self._keep_alive = config.keep_alive

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine process (it loads the model) unless it runs already; returns once it runs."""
        with self._lock:
            self._raise_if_stopped()
            if self._process is None:
                self._start_locked()

    @property
    def engine(self) -> EngineView:
        """What can be read of the child's engine (tokenizer, max_model_len, hf_config, dtype, pid)."""
        self.wait_until_started()
        return self._view

    @property
    def model_info(self):
        self.wait_until_started()
        return self._model_info

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before it started)."""
        return None if self._process is None else self._process.pid

    @property
    def is_sleeping(self) -> bool:
        return self._process is not None and self._started.is_set() and not self.is_stopped \
            and bool(self._call("is_sleeping"))

    @property
    def keep_alive(self) -> float | None:
        return self._keep_alive

    def sleep(self, level: int = 1, timeout: float | None = None) -> None:
        """As :meth:`EngineCore.sleep`, in the child."""
        check_sleep_level(level)
        check_timeout(timeout)
        with self._lock:
            self._raise_if_stopped()
            if self._process is None:
                return
        self.wait_until_started()
        self._call("sleep", (level, timeout))

    def wake_up(self, timeout: float | None = None) -> None:
        check_timeout(timeout)
        self.wait_until_started()
        self._call("wake_up", (timeout,))

    def set_keep_alive(self, keep_alive, sleep_level: int | None = None) -> None:
        seconds = parse_seconds("keep_alive", keep_alive)
        if sleep_level is not None:
            check_sleep_level(sleep_level)
        with self._lock:
            self._keep_alive = seconds
            if self._process is None:  # the child starts with it
                self.config = replace(self.config, keep_alive=seconds,
                                      sleep_level=self.config.sleep_level if sleep_level is None else sleep_level)
                return
        self._call("set_keep_alive", (seconds, sleep_level))

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Stop the engine process: pending requests raise :class:`EngineClosedError`; it is reaped."""
        with self._lock:
            self._is_closing = True
            process, reader = self._process, self._reader
        if process is None:
            self._stop(EngineClosedError("the engine was closed"))
            return
        self._send(Close())
        process.join(timeout)
        if process.is_alive():
            logger.warning("the engine process %d for %r did not stop within %s s; killed", process.pid,
                           self.config.model, timeout)
            process.kill()
            process.join(5.0)
        if reader is not threading.current_thread():
            reader.join(5.0)

    # ---- requests --------------------------------------------------------------------------

    def add_requests(self, prompts, sampling_params, request_ids=None, priorities=None, cache_salt=None,
                     timeout: float | None = None, lora_requests=None) -> list[RequestStream]:
        """As :meth:`EngineCore.add_requests`: checked here, queued in the child as one batch."""
        checked = check_requests(prompts, sampling_params, request_ids, priorities, cache_salt, timeout,
                                 lora_requests)
        self.start()
        streams = {stream.stream_id: stream for stream in (self._new_stream(c.request_id, timeout) for c in checked)}
        with self._lock:
            self._raise_if_stopped()
            self._streams.update(streams)  # before the child can answer: outputs may come before the reply
        try:
            self._call_with(lambda call_id: AddRequests(
                call_id, list(streams), [c.prompt for c in checked], [c.sampling_params for c in checked],
                [c.request_id for c in checked], [c.priority for c in checked], cache_salt,
                [c.lora_request for c in checked]))
        except BaseException:
            with self._lock:
                for stream_id in streams:
                    self._streams.pop(stream_id, None)
            raise
        return list(streams.values())

    def _new_stream(self, request_id: str, timeout: float | None) -> RequestStream:
        stream = self._make_stream(request_id, timeout)
        stream.stream_id = next(self._ids)  # the child's name for it
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (all its samples) before the child's next step; unknown ids are ignored."""
        if self._process is not None and not self.is_stopped:
            self._send(Abort(request_id=str(request_id)))

    def stats(self) -> dict:
        """The child engine's counters (as :meth:`EngineCore.stats`); the last ones seen once it stopped."""
        if self._process is not None and self._started.is_set() and not self.is_stopped:
            try:
                self._stats = self._call("stats")
            except EngineDeadError:
                pass
        return dict(self._stats)

    def metrics_text(self) -> bytes | None:
        """The child's Prometheus exposition (its engine's ``vllm:*`` metrics live in its own
        registry), or None without prometheus_client there or before the engine started."""
        if self._process is None or not self._started.is_set() or self.is_stopped:
            return None
        return self._call("metrics_text")

    # ---- talking to the child ----------------------------------------------------------------

    def _start_locked(self) -> None:
        context = _process_context()
        parent_end, child_end = context.Pipe()
        name = f"hearth-engine-{os.path.basename(str(self.config.model))}"
        process = context.Process(target=core_process_main, args=(self.config, child_end, _engine_log_level()),
                                  name=name, daemon=True)
        with _main_module_hidden():
            process.start()
        child_end.close()
        self._process, self._conn = process, parent_end
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    def _send(self, message) -> bool:
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (BrokenPipeError, EOFError, OSError):
            return False  # the reader sees the child gone and stops the engine

    def _call(self, method: str, args: tuple = ()):
        return self._call_with(lambda call_id: Call(call_id, method, args))

    def _call_with(self, make_message):
        call_id = next(self._ids)
        pending = _PendingCall()
        with self._lock:
            self._raise_if_stopped()
            self._calls[call_id] = pending
        self._send(make_message(call_id))
        if not pending.done.wait(CALL_TIMEOUT_S):
            raise EngineDeadError(f"the engine process for {self.config.model!r} did not answer within "
                                  f"{CALL_TIMEOUT_S:g} s")
        if pending.error is not None:
            raise pending.error
        return pending.value

    def _abort_stream(self, stream: RequestStream) -> None:
        stream_id = getattr(stream, "stream_id", None)
        if stream_id is not None and not self.is_stopped:
            self._send(Abort(stream_id=stream_id))

    def _is_serving(self) -> bool:
        # Every stream asks this each time it wakes (once per token per stream in a server). The
        # reader thread watches the child's exit (its sentinel) and records it in _stop_error, so no
        # process poll here: a live child's is_alive() is a select() call, ~35 us on the 2-core machine.
        reader = self._reader
        return reader is not None and self._stop_error is None and reader.is_alive()

    # ---- the reader thread -------------------------------------------------------------------

    def _read(self) -> None:
        conn, process = self._conn, self._process
        stop_error = None
        try:
            while True:
                try:
                    ready = connection.wait([conn, process.sentinel])
                    if conn not in ready:
                        break  # the child exited and left nothing more to read
                    message = conn.recv()
                except (EOFError, OSError):  # the child is gone (or this end was closed)
                    break
                if isinstance(message, Stopped):
                    stop_error = message.error
                    self._send(Close())  # the child's loop has ended; let its process go
                else:
                    self._handle(message)
        except BaseException:  # noqa: BLE001 - a reader that dies must still fail the requests
            logger.exception("the reader of the engine process for %r died", self.config.model)
        process.join(5.0)
        if stop_error is None or (isinstance(stop_error, EngineClosedError) and not self._is_closing):
            stop_error = EngineDeadError(f"the engine process (pid {process.pid}) for model {self.config.model!r} "
                                         f"died (exit code {process.exitcode})")
        conn.close()
        self._stop(stop_error)

    def _handle(self, message) -> None:
        if isinstance(message, Outputs):
            for entry in message.items:
                self._deliver_entry(entry)
        elif isinstance(message, Output):
            self._deliver(message.stream_id, message.item)
        elif isinstance(message, Reply):
            with self._lock:
                pending = self._calls.pop(message.call_id, None)
            if pending is not None:
                pending.value, pending.error = message.value, message.error
                pending.done.set()
        elif isinstance(message, Started):
            if message.error is not None:
                self._startup_error = message.error
            else:
                self._view, self._model_info, self._stats = message.view, message.model_info, message.stats
            self._started.set()

    def _deliver_entry(self, entry: tuple) -> None:
        """An :class:`Outputs` entry, its compact form rebuilt for the stream it names."""
        stream_id = entry[0]
        with self._lock:
            stream = self._streams.get(stream_id)
            if stream is None:
                return
            item = expanded(stream.request_id, entry)
            if is_last_item(item):
                del self._streams[stream_id]
        deliver(stream, item, self._abort_stream)

    def _deliver(self, stream_id: int, item) -> None:
        with self._lock:
            stream = self._streams.pop(stream_id, None) if is_last_item(item) else self._streams.get(stream_id)
        if stream is not None:
            deliver(stream, item, self._abort_stream)

    def _stop(self, error: EngineDeadError) -> None:
        """Fail every pending request and call with ``error``; later calls raise it too."""
        with self._lock:
            if self._stop_error is None:
                self._stop_error = error
            streams, self._streams = list(self._streams.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for stream in streams:
            stream.put(error_like(error))
        for pending in calls:
            pending.error = error_like(error)
            pending.done.set()
        self._started.set()
        if self._on_stop is not None:
            self._on_stop(self)
