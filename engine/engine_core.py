"""``EngineCore``: one model's :class:`LLMEngine` on its own thread.

Requests reach the engine thread as commands (add, abort) and come back through one
``RequestStream`` each, which any thread or event loop can read. The thread applies queued
commands between steps, so an abort frees its blocks before the next step starts.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .chat.prompt import ChatPrompt
from .config import EngineConfig
from .errors import EngineClosedError, EngineDeadError, EngineOverloadedError, RequestFailedError
from .input_processor import BatchRejectedError, RequestInput, request_input
from .llm_engine import LLMEngine
from .model_info import ModelInfo, model_info_of
from .output_processor import RequestDelta, mark_last, stream_output
from .outputs import StreamOutput
from .sampling_params import SamplingParams
from .streams import RequestStream

logger = logging.getLogger("hearth_llm")


@dataclass(slots=True)
class _AddRequest:
    stream: RequestStream
    input: RequestInput  # its arguments checked on the caller's thread; the prompt on the engine's


@dataclass(slots=True)
class _AddRequests:
    adds: list[_AddRequest]  # all admitted in one go, or none


@dataclass(slots=True)
class _AbortRequest:
    request_id: str
    stream: RequestStream | None = None  # when set, abort only if this stream still owns the id


class EngineCore:
    """One model's :class:`LLMEngine` on its own thread, shared by every handle on the same
    model and config. Thread-safe: any thread or event loop may add, read and abort requests.

    >>> core = get_engine("default")               # cheap: the model loads on first use
    >>> stream = core.add_request("Hello", SamplingParams(temperature=0, max_tokens=8))
    >>> "".join(out.delta_text for out in stream)
    >>> core.stats()["num_running"]

    Handles (``AsyncLLM``, ``LLM``) ``attach()`` on creation and ``detach()`` on ``close()``; the
    engine stops when the last one detaches, at ``close()``, or at interpreter exit.
    """

    def __init__(self, config: EngineConfig, on_stop: Callable[[EngineCore], None] | None = None):
        self.config = config
        self._on_stop = on_stop
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._commands: deque[_AddRequests | _AbortRequest] = deque()
        self._num_queued_adds = 0
        self._num_waiting = 0            # the scheduler's waiting queue, as of the last step
        self._num_handles = 0
        self._is_closing = False
        self._stop_error: EngineDeadError | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._startup_error: BaseException | None = None
        self._engine: LLMEngine | None = None
        self._model_info: ModelInfo | None = None
        self._stats: dict = {}
        self._streams: dict[str, RequestStream] = {}   # touched by the engine thread only

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (it loads the model) unless it runs already; returns at once."""
        with self._lock:
            self._raise_if_stopped()
            self._start_locked()

    def wait_until_started(self, timeout: float | None = None) -> None:
        """Start and block until the model is loaded; raises what loading raised."""
        self.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"the engine for model {self.config.model!r} did not start within {timeout} s")
        if self._startup_error is not None:
            raise self._startup_error
        self._raise_if_stopped()

    @property
    def engine(self) -> LLMEngine:
        """The underlying engine, loaded if needed. Read it (``tokenizer``, ``max_model_len``);
        do not call its methods: only the engine thread may."""
        self.wait_until_started()
        return self._engine

    @property
    def model_info(self) -> ModelInfo:
        """Public facts of the model (type, context length, chat template), loaded if needed."""
        self.wait_until_started()
        return self._model_info

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_stopped(self) -> bool:
        return self._is_closing or self._stop_error is not None

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

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the engine: pending requests raise :class:`EngineClosedError`; the thread is joined."""
        with self._lock:
            self._is_closing = True
            self._has_work.notify()
            thread = self._thread
        if thread is None:
            self._stop(EngineClosedError("the engine was closed"), None)
        elif thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the engine thread for %r did not stop within %s s", self.config.model, timeout)

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int] | ChatPrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> RequestStream:
        """Queue a request; returns its stream at once. Invalid sampling parameters raise here,
        invalid prompts when the stream is read. Raises :class:`EngineOverloadedError` when
        ``max_waiting_requests`` sequences are already waiting."""
        return self.add_requests([prompt], [sampling_params], [request_id], [priority], cache_salt, timeout)[0]

    def add_requests(
        self,
        prompts: list[str | list[int] | ChatPrompt],
        sampling_params: list[SamplingParams | None],
        request_ids: list[str | None] | None = None,
        priorities: list[int] | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> list[RequestStream]:
        """Queue several requests as one: the engine admits all of them before its next step, or,
        if one prompt is invalid, none (every stream then raises that prompt's error)."""
        count = len(prompts)
        request_ids = list(request_ids) if request_ids is not None else [None] * count
        priorities = list(priorities) if priorities is not None else [0] * count
        if not (len(sampling_params) == len(request_ids) == len(priorities) == count):
            raise ValueError(f"add_requests got {count} prompts but {len(sampling_params)} sampling_params, "
                             f"{len(request_ids)} request_ids and {len(priorities)} priorities")
        _check_timeout(timeout)
        adds = [self._new_add(prompt, params, request_id, priority, cache_salt, timeout)
                for prompt, params, request_id, priority in zip(prompts, sampling_params, request_ids, priorities)]
        num_sequences = sum(add.input.sampling_params.n for add in adds)
        with self._lock:
            self._raise_if_stopped()
            num_waiting = self._num_waiting + self._num_queued_adds
            if num_waiting + num_sequences > self.config.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{num_waiting} sequences are waiting, {num_sequences} more would pass "
                    f"max_waiting_requests={self.config.max_waiting_requests}; retry later or raise max_waiting_requests")
            self._commands.append(_AddRequests(adds))
            self._num_queued_adds += num_sequences
            self._has_work.notify()
            self._start_locked()
        return [add.stream for add in adds]

    def _new_add(self, prompt, params, request_id, priority, cache_salt, timeout) -> _AddRequest:
        checked = request_input(prompt, params, request_id, priority, cache_salt)
        stream = RequestStream(checked.request_id, timeout, abort=self._abort_stream,
                               is_engine_alive=self._is_thread_alive, model=str(self.config.model))
        return _AddRequest(stream, checked)

    def abort(self, request_id: str) -> None:
        """Abort a request (all its samples) before the next step; unknown or finished ids are ignored."""
        self._enqueue(_AbortRequest(str(request_id)))

    def stats(self) -> dict:
        """The engine's counters after its last step (empty before the model loaded)."""
        stats = dict(self._stats)
        stats["num_queued"] = self._num_queued_adds
        return stats

    def _abort_stream(self, stream: RequestStream) -> None:
        self._enqueue(_AbortRequest(stream.request_id, stream))

    def _enqueue(self, command) -> None:
        with self._lock:
            if self.is_stopped:
                return  # every request is gone already
            self._commands.append(command)
            self._has_work.notify()

    def _raise_if_stopped(self) -> None:
        if self._stop_error is not None:
            raise _error_like(self._stop_error)
        if self._is_closing:
            raise EngineClosedError("the engine was closed")

    def _start_locked(self) -> None:
        if self._thread is None:
            name = f"hearth-engine-{os.path.basename(str(self.config.model))}"
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _is_thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = LLMEngine(self.config)
        except BaseException as error:  # noqa: BLE001 - every caller must hear of it
            self._startup_error = error
            self._stop(EngineDeadError(f"the engine for model {self.config.model!r} failed to start: {error}"), error)
            return
        self._engine = engine
        self._model_info = model_info_of(engine)
        self._stats = engine.stats()
        self._started.set()
        try:
            while self._serve_once(engine):
                pass
        except BaseException as error:  # noqa: BLE001 - turn any loop failure into prompt errors
            logger.exception("the engine loop for %r died", self.config.model)
            self._stop(EngineDeadError(f"the engine loop died: {type(error).__name__}: {error}"), error)
        else:
            self._stop(EngineClosedError("the engine was closed"), None)

    def _serve_once(self, engine: LLMEngine) -> bool:
        with self._lock:
            while not (self._commands or self._is_closing or engine.has_unfinished_requests()):
                self._has_work.wait()
            if self._is_closing:
                return False
            commands = list(self._commands)
            self._commands.clear()
            self._num_waiting += self._num_queued_adds
            self._num_queued_adds = 0
        for command in commands:
            if isinstance(command, _AddRequests):
                self._apply_adds(engine, command.adds)
            else:
                self._apply_abort(engine, command)
        if engine.has_unfinished_requests():
            self._dispatch(engine, engine.step())
        self._stats = stats = engine.stats()
        self._num_waiting = stats["num_waiting"]
        return True

    def _apply_adds(self, engine: LLMEngine, adds: list[_AddRequest]) -> None:
        try:
            engine.add_requests([add.input for add in adds])
        except BatchRejectedError as rejected:  # nothing of the batch was queued
            for index, add in enumerate(adds):
                add.stream.put(rejected.error_for(index))
            return
        for add in adds:
            self._streams[add.stream.request_id] = add.stream

    def _apply_abort(self, engine: LLMEngine, command: _AbortRequest) -> None:
        stream = self._streams.get(command.request_id)
        if stream is None or (command.stream is not None and command.stream is not stream):
            return
        engine.abort_request(command.request_id)
        output = StreamOutput(command.request_id, "", [], finish_reason="abort")
        stream.put(mark_last(output, engine.groups[command.request_id]))
        self._forget(engine, command.request_id)

    def _dispatch(self, engine: LLMEngine, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            group_id = delta.request.group_id
            stream = self._streams.get(group_id)
            if stream is None:
                continue  # its group failed earlier in this step
            if delta.error is not None:
                engine.abort_request(group_id)  # the other samples of the request, if any
                stream.put(_request_failed(group_id, delta.error))
                self._forget(engine, group_id)
                continue
            children = engine.groups[group_id]
            is_group_finished = all(child.is_finished for child in children)
            output = stream_output(delta)
            if is_group_finished:
                mark_last(output, children)
            if not stream.put(output):
                engine.abort_request(group_id)
                is_group_finished = True
            if is_group_finished:
                self._forget(engine, group_id)

    def _forget(self, engine: LLMEngine, request_id: str) -> None:
        engine.release(request_id)
        del self._streams[request_id]

    def _stop(self, error: EngineDeadError, cause: BaseException | None) -> None:
        """Fail every pending and queued request with ``error``; later calls raise it too."""
        error.__cause__ = cause
        with self._lock:
            if self._stop_error is None:
                self._stop_error = error
            commands = list(self._commands)
            self._commands.clear()
            self._num_queued_adds = 0
        streams = list(self._streams.values())
        streams += [add.stream for command in commands if isinstance(command, _AddRequests) for add in command.adds]
        self._streams.clear()
        for stream in streams:
            stream.put(_error_like(error))
        self._engine = None  # let the weights and the KV cache go
        self._started.set()
        if self._on_stop is not None:
            self._on_stop(self)


def _request_failed(request_id: str, cause: BaseException) -> RequestFailedError:
    error = RequestFailedError(f"request {request_id!r} failed: {type(cause).__name__}: {cause}")
    error.__cause__ = cause
    return error


def _error_like(error: EngineDeadError) -> EngineDeadError:
    """A fresh copy per raise site, so tracebacks do not pile up on one shared instance."""
    copy = type(error)(*error.args)
    copy.__cause__ = error.__cause__
    return copy


def _check_timeout(timeout: float | None) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
