"""``EngineCore``: one model's :class:`LLMEngine` on its own thread.

Requests reach the engine thread as commands (add, abort, sleep, wake) and come back through one
``RequestStream`` each, which any thread or event loop can read. The thread applies queued
commands between steps, so an abort frees its blocks before the next step starts.

The engine's weights and KV cache are booked against its device's memory budget (``.memory``),
shared by every engine in the process: another engine may take back free KV blocks between two
steps (under ``_step_lock``), and an idle engine can sleep (``sleep()``, or ``keep_alive``) and
wakes when the next request arrives.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from .chat.prompt import ChatPrompt
from .config import EngineConfig
from .core_front import CoreFront, check_requests, check_timeout, error_like
from .errors import EngineClosedError, EngineDeadError, EngineOverloadedError, RequestFailedError
from .input_processor import BatchRejectedError, RequestInput
from .llm_engine import LLMEngine
from .loader import load_checkpoint
from .memory.holders import EngineMemory, plan_load
from .memory.sleep import SleepState, check_sleep_level, deepen_sleep, put_to_sleep, wake_up
from .model_info import ModelInfo, model_info_of
from .openmp_threads import release_caller_threads
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


@dataclass(slots=True, eq=False)
class _Sleep:
    level: int
    done: threading.Event | None = None  # None: keep_alive's own sleep, nobody waits
    error: BaseException | None = None


@dataclass(slots=True, eq=False)
class _Wake:
    done: threading.Event
    error: BaseException | None = None


class EngineCore(CoreFront):
    """One model's :class:`LLMEngine` on its own thread, shared by every handle on the same
    model and config. Thread-safe: any thread or event loop may add, read and abort requests.

    >>> core = get_engine("default")               # cheap: the model loads on first use
    >>> stream = core.add_request("Hello", SamplingParams(temperature=0, max_tokens=8))
    >>> "".join(out.delta_text for out in stream)
    >>> core.stats()["num_running"]

    Handles (``AsyncLLM``, ``LLM``) ``attach()`` on creation and ``detach()`` on ``close()``; the
    engine stops when the last one detaches, at ``close()``, or at interpreter exit.

    >>> core.sleep(level=1)      # once idle: KV cache dropped, weights to host memory on a GPU
    >>> core.is_sleeping
    True
    >>> core.add_request("Hi", SamplingParams(max_tokens=4))   # wakes it first, then serves it
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
        # Held by the engine thread while it touches the engine; another engine's load takes it
        # to shrink this one's KV cache between two steps.
        self._step_lock = threading.Lock()
        self._memory = EngineMemory(f"engine {os.path.basename(str(config.model))!r}", config.torch_device,
                                    self._step_lock, on_resized=self._refresh_stats)
        self._sleep_state: SleepState | None = None
        self._pending_sleeps: list[_Sleep] = []
        self._keep_alive = config.keep_alive
        self._sleep_level = config.sleep_level
        self._last_active = time.monotonic()
        self._releases_caller_threads = config.release_caller_threads and config.torch_device.type == "cpu"

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (it loads the model) unless it runs already; returns at once."""
        with self._lock:
            self._raise_if_stopped()
            self._start_locked()

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
    def is_sleeping(self) -> bool:
        return self._sleep_state is not None

    @property
    def keep_alive(self) -> float | None:
        """Idle seconds before the engine sleeps by itself; None: never."""
        return self._keep_alive

    def sleep(self, level: int = 1, timeout: float | None = None) -> None:
        """Put the engine to sleep as soon as it holds no request (running ones finish first);
        blocks until it sleeps. Level 1 drops the KV cache and, on a GPU, moves the weights to
        pinned host memory; level 2 drops both (waking reloads the checkpoint). The next request,
        or :meth:`wake_up`, wakes it. Not loaded yet: nothing to do."""
        check_sleep_level(level)
        check_timeout(timeout)
        with self._lock:
            self._raise_if_stopped()
            if self._thread is None:
                return
        self._wait_for(_Sleep(level, threading.Event()), timeout)

    def wake_up(self, timeout: float | None = None) -> None:
        """Wake a sleeping engine now (a request would too); loads it if it never was."""
        check_timeout(timeout)
        self.start()
        self._wait_for(_Wake(threading.Event()), timeout)

    def set_keep_alive(self, keep_alive: float | str | None, sleep_level: int | None = None) -> None:
        """Sleep after ``keep_alive`` idle seconds from now on (None: never), at ``sleep_level``."""
        from .config import parse_seconds

        seconds = parse_seconds("keep_alive", keep_alive)
        if sleep_level is not None:
            check_sleep_level(sleep_level)
        with self._lock:
            self._keep_alive = seconds
            if sleep_level is not None:
                self._sleep_level = sleep_level
            self._has_work.notify()

    def _wait_for(self, command: _Sleep | _Wake, timeout: float | None) -> None:
        with self._lock:
            self._raise_if_stopped()
            self._commands.append(command)
            self._has_work.notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not command.done.wait(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the engine for model {self.config.model!r} did not "
                                   f"{'sleep' if isinstance(command, _Sleep) else 'wake'} within {timeout} s")
            if not self._is_thread_alive():
                self._raise_if_stopped()
        if command.error is not None:
            raise command.error

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

    # add_request(prompt, ...), add_requests with one prompt: CoreFront's

    def add_requests(
        self,
        prompts: list[str | list[int] | ChatPrompt],
        sampling_params: list[SamplingParams | None],
        request_ids: list[str | None] | None = None,
        priorities: list[int] | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
        lora_requests: list | None = None,
    ) -> list[RequestStream]:
        """Queue several requests as one: the engine admits all of them before its next step, or,
        if one prompt is invalid, none (every stream then raises that prompt's error)."""
        checked = check_requests(prompts, sampling_params, request_ids, priorities, cache_salt, timeout,
                                 lora_requests)
        adds = [_AddRequest(self._make_stream(c.request_id, timeout), c) for c in checked]
        if self._releases_caller_threads:
            release_caller_threads()  # the caller's idle OpenMP team would throttle the engine's (see .openmp_threads)
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

    def abort(self, request_id: str) -> None:
        """Abort a request (all its samples) before the next step; unknown or finished ids are ignored."""
        self._enqueue(_AbortRequest(str(request_id)))

    def _refresh_stats(self, engine: LLMEngine) -> None:
        """After another engine's load shrank this one's KV cache (under the step lock): an idle
        engine takes no step that would refresh its counters."""
        self._stats = engine.stats()

    def stats(self) -> dict:
        """The engine's counters after its last step (empty before the model loaded), and its
        memory: ``weights_bytes``, ``kv_cache_bytes`` (its share of ``memory_device``'s budget),
        ``is_sleeping``, ``sleep_level``."""
        stats = dict(self._stats)
        stats["num_queued"] = self._num_queued_adds
        stats.update(self._memory.stats())
        return stats

    def _abort_stream(self, stream: RequestStream) -> None:
        self._enqueue(_AbortRequest(stream.request_id, stream))

    def _enqueue(self, command) -> None:
        with self._lock:
            if self.is_stopped:
                return  # every request is gone already
            self._commands.append(command)
            self._has_work.notify()

    def _start_locked(self) -> None:
        if self._thread is None:
            name = f"hearth-engine-{os.path.basename(str(self.config.model))}"
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _is_thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _is_serving(self) -> bool:  # what a request's stream asks before it waits on
        return self._is_thread_alive()

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._load()
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

    def _load(self) -> LLMEngine:
        """Reserve the engine's share of its device's budget (shrinking other engines' free KV if
        needed), then load. Refused by the budget: nothing is read, nothing stays booked."""
        config = self.config
        checkpoint = load_checkpoint(config.model, config.torch_dtype, allow_pickle=config.allow_pickle,
                                     trust_remote_code=config.trust_remote_code, progress=config.show_progress)
        try:
            plan = plan_load(checkpoint, config)
        except Exception:  # noqa: BLE001 - the load below raises the model's own error for it
            plan = None
        try:
            if plan is not None:
                config = replace(config, kv_cache_memory=self._memory.reserve_for_load(plan))
            engine = LLMEngine(config, checkpoint=checkpoint)
        except BaseException:
            self._memory.release_all()
            raise
        self._memory.book_loaded(engine)
        return engine

    def _serve_once(self, engine: LLMEngine) -> bool:
        with self._lock:
            while not (self._commands or self._is_closing or engine.has_unfinished_requests()):
                idle_left = self._keep_alive_left()
                if idle_left is not None and idle_left <= 0:
                    break
                self._has_work.wait(idle_left)
            if self._is_closing:
                return False
            commands = list(self._commands)
            self._commands.clear()
            self._num_waiting += self._num_queued_adds
            self._num_queued_adds = 0
        if not commands and not engine.has_unfinished_requests():
            self._sleep_now(engine, _Sleep(self._sleep_level))  # idle for keep_alive
            return True
        if self._sleep_state is not None and any(isinstance(c, (_AddRequests, _Wake)) for c in commands):
            commands = self._wake(engine, commands)
        with self._step_lock:
            for command in commands:
                self._apply(engine, command)
            outputs = engine.step() if engine.has_unfinished_requests() else None
            # Counters before outputs: a reader woken by its last output sees its blocks freed.
            self._stats = stats = engine.stats()
            self._num_waiting = stats["num_waiting"]
            if outputs is not None and self._dispatch(engine, outputs):
                self._stats = engine.stats()  # and after, when a reader that left had its request aborted
        self._last_active = time.monotonic()
        if self._pending_sleeps and not engine.has_unfinished_requests():
            self._sleep_now(engine)
        return True

    def _apply(self, engine: LLMEngine, command) -> None:
        if isinstance(command, _AddRequests):
            self._apply_adds(engine, command.adds)
        elif isinstance(command, _AbortRequest):
            self._apply_abort(engine, command)
        elif isinstance(command, _Sleep):
            self._pending_sleeps.append(command)  # done once the running requests have finished
        else:
            command.done.set()  # _Wake: awake (or the wake failed and said so)

    # ---- sleep and wake (engine thread) ------------------------------------------------------

    def _keep_alive_left(self) -> float | None:
        """Seconds until keep_alive puts the idle engine to sleep; None: it will not."""
        if self._keep_alive is None or self._sleep_state is not None:
            return None
        return self._last_active + self._keep_alive - time.monotonic()

    def _sleep_now(self, engine: LLMEngine, auto: _Sleep | None = None) -> None:
        sleeps, self._pending_sleeps = self._pending_sleeps + ([auto] if auto else []), []
        level = max(command.level for command in sleeps)
        error = None
        try:
            with self._step_lock:
                if self._sleep_state is None:
                    self._sleep_state = put_to_sleep(engine, level)
                elif level > self._sleep_state.level:
                    deepen_sleep(engine, self._sleep_state)
                self._memory.book_asleep(self._sleep_state)
                self._stats = engine.stats()
            logger.info("the engine for %r sleeps at level %d", self.config.model, self._sleep_state.level)
        except Exception as failure:  # noqa: BLE001 - the caller of sleep() hears of it; serving goes on
            error = failure
            if auto is not None:
                logger.warning("keep_alive could not put %r to sleep (%s); it stays awake", self.config.model, error)
                self._keep_alive = None
        for command in sleeps:
            if command.done is not None:
                command.error = error
                command.done.set()

    def _wake(self, engine: LLMEngine, commands: list) -> list:
        """Wake before serving; if waking fails, the requests that would have woken it fail with
        the reason and the engine sleeps on. Returns the commands left to apply."""
        state = self._sleep_state
        try:
            num_blocks = self._memory.reserve_for_wake(state)
            try:
                with self._step_lock:
                    wake_up(engine, state, num_blocks)
                    self._sleep_state = None
                    self._memory.book_awake()
            except BaseException:
                self._memory.book_asleep(state)
                raise
        except Exception as error:  # noqa: BLE001 - fail what asked for the wake, keep the engine
            logger.exception("the engine for %r could not wake", self.config.model)
            kept = []
            for command in commands:
                if isinstance(command, _AddRequests):
                    for add in command.adds:
                        add.stream.put(_copy_error(error))
                elif isinstance(command, _Wake):
                    command.error = _copy_error(error)
                    command.done.set()
                else:
                    kept.append(command)
            return kept
        logger.info("the engine for %r woke from level %d with %d KV blocks", self.config.model, state.level,
                    num_blocks)
        return commands

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

    def _dispatch(self, engine: LLMEngine, deltas: list[RequestDelta]) -> bool:
        """Hand each delta to its stream; True when a request was aborted (its blocks freed) meanwhile."""
        # Samples of one request (n > 1) that finish in the same step each have a delta: the group
        # ends only at its last one, or the siblings after it would find their stream gone.
        last_delta_of = {delta.request.group_id: index for index, delta in enumerate(deltas)}
        aborted = False
        for index, delta in enumerate(deltas):
            group_id = delta.request.group_id
            stream = self._streams.get(group_id)
            if stream is None:
                continue  # its group failed earlier in this step
            if delta.error is not None:
                engine.abort_request(group_id)  # the other samples of the request, if any
                aborted = True
                stream.put(_request_failed(group_id, delta.error))
                self._forget(engine, group_id)
                continue
            children = engine.groups[group_id]
            is_group_finished = index == last_delta_of[group_id] and all(child.is_finished for child in children)
            output = stream_output(delta)
            if is_group_finished:
                mark_last(output, children)
            if not stream.put(output):
                engine.abort_request(group_id)
                is_group_finished = aborted = True
            if is_group_finished:
                self._forget(engine, group_id)
        return aborted

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
            stream.put(error_like(error))
        waiters = [c for c in commands + self._pending_sleeps if isinstance(c, (_Sleep, _Wake)) and c.done]
        self._pending_sleeps = []
        for waiter in waiters:
            waiter.error = error_like(error)
            waiter.done.set()
        self._engine = None  # let the weights and the KV cache go
        with self._step_lock:  # not while another engine's load is shrinking this one
            self._memory.engine = None
            self._memory.release_all()
        self._started.set()
        if self._on_stop is not None:
            self._on_stop(self)


def _request_failed(request_id: str, cause: BaseException) -> RequestFailedError:
    error = RequestFailedError(f"request {request_id!r} failed: {type(cause).__name__}: {cause}")
    error.__cause__ = cause
    return error


def _copy_error(error: BaseException) -> BaseException:
    """A fresh exception per stream, with the original as its cause."""
    try:
        copy = type(error)(*error.args)
    except Exception:  # noqa: BLE001 - an exception type with another signature
        copy = RuntimeError(str(error))
    copy.__cause__ = error
    return copy
