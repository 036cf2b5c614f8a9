"""One engine per model and config in a process: ``get_engine`` hands out a shared ``EngineCore``,
a background thread that owns an ``LLMEngine``, so ``LLM``, ``AsyncLLM`` and the LangChain and
LlamaIndex classes on the same model share one KV cache and its prefix reuse.

Requests reach the engine thread as commands (add, abort) and come back through one
``RequestStream`` each, which any thread or event loop can read. The thread applies queued
commands between steps, so an abort frees its blocks before the next step starts.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import math
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, fields

import jinja2

from .config import EngineConfig
from .errors import (EngineClosedError, EngineDeadError, EngineOverloadedError, RequestFailedError,
                     RequestTimeoutError)
from .llm_engine import LLMEngine, RequestDelta
from .loader import DEFAULT_MODEL, default_model_path
from .outputs import Logprob
from .request import Request
from .sampling_params import SamplingParams
from .tool_calling import render_chat_with_tools

logger = logging.getLogger("hearth_llm")

# A reader that waits re-checks this often that the engine thread still lives, so nothing hangs.
LIVENESS_POLL_S = 1.0
# Options that do not change what the engine computes; handles that differ only in them share one.
_OPTIONS_NOT_IN_KEY = frozenset({"show_progress"})


@dataclass(slots=True)
class Usage:
    """Token counts of a finished request; ``cached_tokens`` of the prompt came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class StreamOutput:
    """What one engine step produced for one request (one sample of it when ``n > 1``).

    ``finish_reason`` is set on a sample's last output; ``finished``, ``usage`` and the prompt's
    token ids (and ``prompt_logprobs`` when asked) only on the request's very last output.
    """

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    index: int = 0
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finished: bool = False
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(slots=True)
class ChatPrompt:
    """A conversation that the engine renders with the model's chat template, then tokenizes.

    >>> ChatPrompt([{"role": "user", "content": "Hi!"}])
    """

    messages: list[dict]
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None  # offered to the model; see tool_calling.render_chat_with_tools

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        self.messages = [_text_message(index, message) for index, message in enumerate(self.messages)]
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict or None, got {type(self.chat_template_kwargs).__name__}")
        if self.tools is not None and not isinstance(self.tools, list):
            raise ValueError(f"tools must be a list or None, got {type(self.tools).__name__}")


def _text_message(index: int, message: object) -> dict:
    """The message with OpenAI-style text parts joined into one string (the engine is text-only)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
        raise ValueError(f"messages[{index}] must be a dict with a non-empty string 'role', got {message!r:.80}")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}]['content'] must be a string, a list of text parts or None, "
                         f"got {type(content).__name__}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{index}]['content']: only {{'type': 'text', 'text': ...}} parts are "
                             f"supported, got {part!r:.80}")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


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


@dataclass(slots=True)
class _AddRequest:
    stream: RequestStream
    prompt: str | list[int] | ChatPrompt
    params: SamplingParams
    priority: int
    cache_salt: str | None


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
        num_sequences = sum(add.params.n for add in adds)
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
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        return _AddRequest(RequestStream(self, request_id, timeout), prompt, params, priority, cache_salt)

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
        prompts: list[str | list[int]] = []
        for index, add in enumerate(adds):
            try:  # check every prompt before queueing any, so a bad one leaves no trace
                prompt = add.prompt
                if isinstance(prompt, ChatPrompt):
                    prompt = render_chat_prompt(engine.tokenizer, prompt)
                engine.check_prompt(prompt, add.params)
                prompts.append(prompt)
            except Exception as error:
                for other in adds:
                    other.stream.put(error if other is add or len(adds) == 1 else _in_batch_error(error, index))
                return
        added: list[str] = []
        for index, (add, prompt) in enumerate(zip(adds, prompts)):
            try:
                engine.add_request(prompt, add.params, add.stream.request_id, add.priority, add.cache_salt)
            except Exception as error:  # invalid input fails these requests only
                for request_id in added:
                    engine.abort_request(request_id)
                    engine.release(request_id)
                for other in adds:
                    other.stream.put(error if other is add or len(adds) == 1 else
                                     _in_batch_error(error, index))
                return
            added.append(add.stream.request_id)
        for add in adds:
            self._streams[add.stream.request_id] = add.stream

    def _apply_abort(self, engine: LLMEngine, command: _AbortRequest) -> None:
        stream = self._streams.get(command.request_id)
        if stream is None or (command.stream is not None and command.stream is not stream):
            return
        engine.abort_request(command.request_id)
        output = StreamOutput(command.request_id, "", [], finish_reason="abort")
        stream.put(_mark_last(output, engine.groups[command.request_id]))
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
            output = _stream_output(delta)
            if is_group_finished:
                _mark_last(output, children)
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


def _stream_output(delta: RequestDelta) -> StreamOutput:
    request = delta.request
    wants_logprobs = request.sampling_params.logprobs is not None and delta.new_token_ids
    return StreamOutput(
        request_id=request.group_id,
        delta_text=delta.new_text,
        delta_token_ids=list(delta.new_token_ids),
        index=request.sample_index,
        finish_reason=request.finish_reason if delta.is_finished else None,
        stop_reason=request.stop_reason if delta.is_finished else None,
        logprobs=request.logprobs[-len(delta.new_token_ids):] if wants_logprobs else None,
    )


def _mark_last(output: StreamOutput, children: list[Request]) -> StreamOutput:
    first = children[0]
    output.finished = True
    output.usage = _usage(children)
    output.prompt_token_ids = first.prompt_token_ids
    output.prompt_logprobs = first.prompt_logprobs or None
    return output


def _usage(children: list[Request]) -> Usage:
    first = children[0]
    return Usage(prompt_tokens=first.num_prompt_tokens,
                 completion_tokens=sum(child.num_output_tokens for child in children),
                 cached_tokens=max(first.num_cached_tokens, 0))


def _request_failed(request_id: str, cause: BaseException) -> RequestFailedError:
    error = RequestFailedError(f"request {request_id!r} failed: {type(cause).__name__}: {cause}")
    error.__cause__ = cause
    return error


def _in_batch_error(error: Exception, index: int) -> ValueError:
    copy = ValueError(f"prompt {index} of this batch is invalid, so none was queued: {error}")
    copy.__cause__ = error
    return copy


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


def render_chat_prompt(tokenizer, prompt: ChatPrompt) -> str:
    """The conversation as the model's chat template renders it, with ``prompt.tools`` offered.

    Templates that know nothing of tools still show earlier tool calls and results, in the hermes
    convention (see :mod:`.tool_calling`).
    """
    if tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    # transformers renders templates in jinja2's ImmutableSandboxedEnvironment: a template (which a
    # GGUF file or model repo supplies) cannot reach Python internals; its errors become ValueError here.
    try:
        return render_chat_with_tools(tokenizer, prompt.messages, prompt.tools, prompt.add_generation_prompt,
                                      prompt.chat_template_kwargs)
    except jinja2.exceptions.SecurityError as error:
        raise ValueError(f"chat template: refused an unsafe operation in the model's template ({error})") from error
    except jinja2.exceptions.TemplateError as error:
        raise ValueError(f"messages: the model's chat template rejected the conversation ({error})") from error


# ---- the registry --------------------------------------------------------------------------

_registry_lock = threading.Lock()
_cores: dict[tuple, EngineCore] = {}


def get_engine(model: str = "default", **engine_kwargs) -> EngineCore:
    """The process's shared engine for this model and config; created (not loaded) on first ask.

    >>> from hearth_llm.engine import get_engine
    >>> get_engine("default") is get_engine("default", dtype="auto")
    True

    Keyword arguments are :class:`EngineConfig` fields; the first handle's ``show_progress`` wins.
    A stopped engine (closed or dead) is replaced by a fresh one.
    """
    config = EngineConfig.from_kwargs(model, **engine_kwargs)
    key = _config_key(config)
    with _registry_lock:
        core = _cores.get(key)
        if core is None or core.is_stopped:
            core = EngineCore(config, on_stop=_forget_core)
            _cores[key] = core
        return core


def shutdown_engines() -> None:
    """Close every shared engine (runs at interpreter exit)."""
    with _registry_lock:
        cores = list(_cores.values())
    for core in cores:
        core.close()


def _forget_core(core: EngineCore) -> None:
    with _registry_lock:
        for key, value in list(_cores.items()):
            if value is core:
                del _cores[key]


def _config_key(config: EngineConfig) -> tuple:
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in _OPTIONS_NOT_IN_KEY}
    values["model"] = _normalize_model(config.model)
    values["device"] = str(config.torch_device)
    values["dtype"] = str(config.torch_dtype)
    return tuple(sorted(values.items()))


def _normalize_model(model: str) -> str:
    """One name per checkpoint, so ``"default"`` and the bundled file's path share an engine."""
    if model == DEFAULT_MODEL:
        try:
            model = str(default_model_path())
        except ValueError:
            return model  # not installed: loading will say so
    path = os.path.expanduser(model)
    return os.path.realpath(path) if os.path.exists(path) else model


atexit.register(shutdown_engines)
