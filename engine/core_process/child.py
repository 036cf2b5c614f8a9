"""The child process of ``engine_core="process"``: a plain :class:`~..engine_core.EngineCore` whose
streams write to the pipe instead of to a reader in this process.

Its main thread reads the parent's messages and applies them to the core (adds, aborts, calls);
the core's own thread runs the steps, and the outputs one step hands to its streams go to the
parent together, as one :class:`~.messages.Outputs`. The child ends when the parent says
:class:`Close`, when the parent's end of the pipe closes (the parent died: no orphan stays), or
after its engine stopped.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import signal
import threading
import types
from collections import deque
from dataclasses import replace

from ..core_front import is_last_item
from ..engine_core import EngineCore
from ..errors import EngineDeadError
from ..outputs import StreamOutput
from .messages import (Abort, AddRequests, Call, Close, EngineView, Output, Outputs, Reply, Started, Stopped,
                       compact)

# Calls that wait for the engine (sleep finishes the running requests first): each gets a thread,
# so aborts and adds keep flowing meanwhile.
_BLOCKING_CALLS = frozenset({"sleep", "wake_up"})
_CALLS = frozenset({"stats", "set_keep_alive", "is_sleeping", "metrics_text"}) | _BLOCKING_CALLS


class _Link:
    """The child's end of the pipe, shared by the main thread and the engine thread."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        self._batch: list[tuple[int, object]] = []
        self._batch_thread: int | None = None  # the thread inside ``batched()``, if any

    @contextlib.contextmanager
    def batched(self):
        """The outputs this thread sends inside go to the parent as one :class:`Outputs` at the end."""
        self._batch, self._batch_thread = [], threading.get_ident()
        try:
            yield
        finally:
            batch, self._batch, self._batch_thread = self._batch, [], None
            if batch:
                self.send(Outputs(batch))

    def send(self, message) -> bool:
        """False when the parent is gone. Exceptions are checked to come back out of pickle whole."""
        if isinstance(message, Output):
            if isinstance(message.item, BaseException):
                message = Output(message.stream_id, picklable_error(message.item))
            if self._batch_thread == threading.get_ident():
                self._batch.append(compact(message.stream_id, message.item))
                return True  # sent with the rest of the step's outputs
        elif isinstance(message, (Reply, Started, Stopped)) and message.error is not None:
            message.error = picklable_error(message.error)
        try:
            with self._lock:
                self.conn.send(message)
            return True
        except (BrokenPipeError, EOFError, OSError):
            return False


def picklable_error(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (an exception pickles as its type and ``args``, and some
    types need other constructor arguments), else a RuntimeError with its type and message."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error):
            return error
    except Exception:  # noqa: BLE001 - any failure means: send the text instead
        pass
    return RuntimeError(f"{type(error).__name__}: {error}")


class _PipeStream:
    """Stands for the parent's ``RequestStream``: what the core puts here is sent over the pipe."""

    def __init__(self, stream_id: int, request_id: str, link: _Link, on_done) -> None:
        self.stream_id = stream_id
        self.request_id = request_id
        self._link = link
        self._on_done = on_done

    def put(self, item: StreamOutput | BaseException) -> bool:
        if is_last_item(item):
            self._on_done(self)
        return self._link.send(Output(self.stream_id, item))


class ChildEngineCore(EngineCore):
    """The core inside the child: its streams are :class:`_PipeStream` objects."""

    def __init__(self, config, link: _Link) -> None:
        super().__init__(replace(config, engine_core="thread"), on_stop=self._report_stop)
        self._link = link
        self._next_stream_ids: deque[int] = deque()   # for the add in progress, in prompt order
        self.pipe_streams: dict[int, _PipeStream] = {}
        self._pipe_lock = threading.Lock()

    def add_for_parent(self, message: AddRequests) -> None:
        self._next_stream_ids.extend(message.stream_ids)
        try:
            self.add_requests(message.prompts, message.sampling_params, message.request_ids, message.priorities,
                              message.cache_salt, None, lora_requests=message.lora_requests)
        except BaseException:  # refused (overloaded, stopped): its streams were never queued
            with self._pipe_lock:
                for stream_id in message.stream_ids:
                    self.pipe_streams.pop(stream_id, None)
            raise
        finally:
            self._next_stream_ids.clear()

    def close_stream(self, stream_id: int) -> None:
        with self._pipe_lock:
            stream = self.pipe_streams.get(stream_id)
        if stream is not None:
            self._abort_stream(stream)

    def _make_stream(self, request_id: str, timeout: float | None) -> _PipeStream:
        # the parent's stream keeps the deadline: only it has a reader to raise RequestTimeoutError in
        stream = _PipeStream(self._next_stream_ids.popleft(), request_id, self._link, self._forget_stream)
        with self._pipe_lock:
            self.pipe_streams[stream.stream_id] = stream
        return stream

    def metrics_text(self) -> bytes | None:
        """This process's Prometheus exposition (the parent's ``/metrics`` shows it)."""
        try:
            from prometheus_client import REGISTRY, generate_latest
        except ImportError:
            return None
        return generate_latest(REGISTRY)

    def _dispatch(self, engine, deltas) -> bool:
        with self._link.batched():  # a step's outputs travel as one message
            return super()._dispatch(engine, deltas)

    def _forget_stream(self, stream: _PipeStream) -> None:
        with self._pipe_lock:
            self.pipe_streams.pop(stream.stream_id, None)

    def _report_stop(self, core: EngineCore) -> None:
        self._link.send(Stopped(self._stop_error or EngineDeadError("the engine stopped")))


def core_process_main(config, conn, log_level: int | None = None) -> None:
    """The child's entry point: serve ``conn`` until the parent closes it or says :class:`Close`.
    ``log_level``: the engine's log lines (``hearth_llm`` loggers) go to stderr from this level up,
    as the parent would have shown them; None: the parent shows none."""
    # Ctrl-C in a terminal reaches the whole process group: the parent decides when this engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_level is not None:
        to_stderr = logging.StreamHandler()
        to_stderr.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("hearth_llm").addHandler(to_stderr)
        logging.getLogger("hearth_llm").setLevel(log_level)
    link = _Link(conn)
    core = ChildEngineCore(config, link)
    core.start()
    threading.Thread(target=_report_start, args=(core, link), name="hearth-core-start", daemon=True).start()
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            if isinstance(message, Close):
                break
            _handle(core, link, message)
    finally:
        core.close()


def _report_start(core: ChildEngineCore, link: _Link) -> None:
    try:
        core.wait_until_started()
    except BaseException as error:  # noqa: BLE001 - the parent's wait_until_started raises it
        link.send(Started(error=error))
        return
    # This process lives for its engine: keep the loaded model's objects out of every later full
    # collection, which would otherwise walk them all (tens to hundreds of ms) with the GIL held.
    gc.collect()
    gc.freeze()
    try:
        engine = core.engine
        view = EngineView(tokenizer=engine.tokenizer, hf_config=_picklable_config(engine.hf_config),
                          max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
                          eos_token_ids=frozenset(engine.eos_token_ids), dtype=engine.runner.dtype, pid=os.getpid())
        pickle.dumps(view)
    except Exception as error:  # noqa: BLE001 - say so rather than leave the parent waiting
        link.send(Started(error=RuntimeError(f"the engine process could not describe its engine: "
                                             f"{type(error).__name__}: {error}")))
        core.close()
        return
    link.send(Started(view, core.model_info, core.stats()))


def _picklable_config(hf_config):
    """The HF config, or its fields as attributes where its class was made at load (a GGUF file's)."""
    try:
        pickle.dumps(hf_config)
        return hf_config
    except Exception:  # noqa: BLE001 - a class pickle cannot find by name
        return types.SimpleNamespace(**hf_config.to_dict())


def _handle(core: ChildEngineCore, link: _Link, message) -> None:
    if isinstance(message, AddRequests):
        _answer(link, message.call_id, lambda: core.add_for_parent(message))
    elif isinstance(message, Abort):
        if message.stream_id is None:
            core.abort(message.request_id)
        else:
            core.close_stream(message.stream_id)
    elif isinstance(message, Call) and message.method in _CALLS:
        run = (lambda: core.is_sleeping) if message.method == "is_sleeping" else \
            (lambda: getattr(core, message.method)(*message.args))
        if message.method in _BLOCKING_CALLS:
            threading.Thread(target=_answer, args=(link, message.call_id, run), daemon=True).start()
        else:
            _answer(link, message.call_id, run)
    else:
        raise TypeError(f"the engine process got an unknown message {message!r}")


def _answer(link: _Link, call_id: int, run) -> None:
    try:
        value = run()
    except Exception as error:  # noqa: BLE001 - raised again in the parent, on the caller's thread
        link.send(Reply(call_id, error=error))
        return
    link.send(Reply(call_id, value))
