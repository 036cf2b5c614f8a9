"""The embedding engine: one background thread that owns the model and serves every caller.

Callers on any thread or event loop submit a list of texts and get a future. The thread takes a
fair share of every waiting request (:func:`~.batching.fair_shares`), tokenizes that step's texts
in one call, sorts them by length and cuts them into batches (:func:`~.batching.plan_batches`),
runs the batches under ``torch.inference_mode`` — side by side on single-threaded workers
(:class:`~.workers.ForwardWorkers`) when there are several, on this thread when there is one, and
on CUDA on one worker thread that feeds the device while this thread tokenizes the next step — and
resolves a request's future when its last text is done. So 64 coroutines that each embed one query
become one or two forward passes, and the event loop never runs the model.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .batching import fair_shares, plan_batches
from .config import EmbeddingConfig
from .errors import (EmbeddingEngineClosedError, EmbeddingEngineDeadError, EmbeddingFailedError,
                     TextTooLongError)
from .model_dir import read_encoder_spec
from .runner import EncoderRunner, choose_implementation, make_runner
from .workers import ForwardWorkers, start_single_threaded

logger = logging.getLogger("hearth_llm")

# Requests of at least this many texts get a progress bar unless they say otherwise.
PROGRESS_MIN_TEXTS = 1000
# A step takes this many batches' worth of texts per worker: enough to sort by length across
# several batches and keep every worker busy, few enough that a query arriving behind a large
# corpus waits briefly. On CUDA a step is one batch's worth of texts: the device works through the
# last step while the next is tokenized, and a small first step gets the device started sooner.
BATCHES_PER_STEP = 4
# Callers that fan out together (``asyncio.gather`` over 64 queries) submit over a few milliseconds.
# Waking from idle, the thread waits until no request has arrived for BURST_QUIET_S (at most
# BURST_MAX_S), so that such a burst becomes one step rather than a first step of one text: a lone
# query pays 0.5 ms, a burst saves a forward pass.
BURST_QUIET_S = 0.0005
BURST_MAX_S = 0.005


@dataclass(slots=True, eq=False)
class _Request:
    texts: Sequence[str]
    truncate: bool
    future: concurrent.futures.Future
    embeddings: torch.Tensor
    progress: tqdm | None
    num_taken: int = 0        # texts handed to steps so far
    num_done: int = 0
    num_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return self.future.done()


@dataclass(slots=True)
class _Item:
    request: _Request
    index: int                # position in request.texts
    token_ids: list[int] = field(default_factory=list)


class EmbeddingEngine:
    """Embeds texts with a sentence-transformers model on a background thread, batching across callers.

    >>> from hearth_llm.embeddings import EmbeddingEngine, EmbeddingConfig
    >>> with EmbeddingEngine(EmbeddingConfig()) as engine:        # all-MiniLM-L6-v2, bundled
    ...     vectors = engine.embed(["The cat sat.", "A dog barked."])   # float32 [2, 384], unit length
    ...     query = engine.embed_one("Where did the cat sit?")          # [384]
    ...     # from a coroutine: await engine.aembed([...]) / await engine.aembed_one("...")

    Use :func:`get_embedding_engine` to share one engine per model in a process. The model loads
    on the first request (or :meth:`start`); bad input raises ``TypeError``/``ValueError`` naming
    the argument; a failed batch fails only its requests (:class:`EmbeddingFailedError`).
    """

    def __init__(self, config: EmbeddingConfig | None = None) -> None:
        self.config = config if config is not None else EmbeddingConfig()
        self.config.validate()
        self.spec = read_encoder_spec(self.config.model, self.config.max_seq_length, pooling=self.config.pooling,
                                      dimensions=self.config.dimensions, task=self.config.task)
        choose_implementation(self.spec, self.config.implementation)   # a config it cannot run: ValueError now
        # resolved here: its default follows the calling thread's torch threads, and the engine
        # thread runs on one
        self.num_workers = self.config.worker_count
        # On CUDA a worker thread runs the batches, so that the next step's tokenization (seconds
        # of CPU for a large corpus, which on one thread would leave the device idle) overlaps them.
        self._runs_on_gpu = self.config.torch_device.type == "cuda"
        self._num_step_batches = 0   # batches the last step handed to the workers
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._waiting: deque[_Request] = deque()
        self._in_step: list[_Request] = []   # taken by steps still running (engine thread only)
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._runner: EncoderRunner | None = None
        self._workers: ForwardWorkers | None = None   # None: batches run on the engine thread
        self._in_flight: dict[concurrent.futures.Future, list[_Item]] = {}   # batches on the workers
        self._stop_error: EmbeddingEngineDeadError | None = None
        self._is_closing = False
        self._memory = None   # the weights' booking in the device's memory budget (hearth_llm.engine.memory)
        self._stats = dict(num_requests=0, num_texts=0, num_steps=0, num_batches=0, num_tokens=0,
                           num_padded_tokens=0)
        _live_engines.add(self)

    # ---- what the model is ------------------------------------------------------------------

    @property
    def dimension(self) -> int:
        """Components of each embedding (``dimensions`` when truncated); 1 for a cross-encoder's scores."""
        return 1 if self.spec.is_cross_encoder else self.spec.dimension

    @property
    def is_reranker(self) -> bool:
        """A cross-encoder or an LLM reranker: :meth:`score` works, :meth:`embed` does not."""
        return self.spec.is_cross_encoder

    @property
    def max_seq_length(self) -> int:
        return self.spec.max_seq_length

    @property
    def implementation(self) -> str:
        """``"hearth"`` or ``"transformers"``; loads the model."""
        return self._loaded_runner().implementation

    @property
    def precision(self) -> str:
        """What the matmuls compute in: ``"float32"``, ``"mixed float32/bfloat16"`` (see
        :class:`EmbeddingConfig`'s ``dtype="auto"``), ...; loads the model."""
        return self._loaded_runner().precision

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, texts: Sequence[str], *, truncate: bool = True, show_progress: bool | None = None,
               prompt_name: str | None = None, prompt: str | None = None) -> concurrent.futures.Future:
        """Queue ``texts``; the future's result is a float32 tensor ``[len(texts), dimension]``.

        ``truncate=False`` fails the request with :class:`TextTooLongError` when a text has more
        than ``max_seq_length`` tokens. ``show_progress=None`` shows a bar for large requests.
        ``prompt_name`` picks one of the model's prompts (``config_sentence_transformers.json``,
        e.g. ``"query"``), ``prompt`` gives the text itself; it goes before every text, as
        sentence-transformers puts it. Neither: the model's ``default_prompt_name``, if any.
        """
        _check_texts(texts, "texts")
        if self.spec.is_cross_encoder:
            raise ValueError(f"{self.spec.path} is a cross-encoder: it scores pairs (score()), it does not embed")
        prefix = self.spec.prompt_for(prompt_name, prompt)
        return self._submit([prefix + text for text in texts] if prefix else list(texts), truncate, show_progress)

    def submit_scores(self, query: str, documents: Sequence[str], *, truncate: bool = True,
                      instruction: str | None = None) -> concurrent.futures.Future:
        """Queue ``documents`` to be scored against ``query`` (a reranker); the future's result
        is a float32 tensor ``[len(documents)]``. ``instruction``: an LLM reranker's task line
        (Qwen3-Reranker's ``<Instruct>``; ``None``: its default web-search one)."""
        _check_text(query, "query")
        _check_texts(documents, "documents")
        if not self.spec.is_cross_encoder:
            raise ValueError(f"{self.spec.path} is not a cross-encoder (no *ForSequenceClassification head) nor an "
                             "LLM reranker (a causal LM with task='score'); score() needs a reranker model")
        if instruction is not None:
            _check_text(instruction, "instruction")
            if not self.spec.is_llm_reranker:
                raise ValueError("instruction applies to an LLM reranker (task='score' on a causal LM), "
                                 f"not to the cross-encoder {self.spec.path}")
        if self.spec.is_llm_reranker:
            return self._submit([(query, document, instruction) for document in documents], truncate, False)
        return self._submit([(query, document) for document in documents], truncate, False)

    def _submit(self, inputs: list, truncate: bool, show_progress: bool | None) -> concurrent.futures.Future:
        if not isinstance(truncate, bool):
            raise TypeError(f"truncate must be True or False, got {truncate!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        request = _Request(texts=inputs, truncate=truncate, future=future,
                           embeddings=torch.empty(len(inputs), self.dimension), progress=None)
        with self._lock:
            self._raise_if_stopped()
            self._start_locked()
            # The bar exists before the engine thread can see the request, which alone updates it.
            request.progress = self._progress_bar(len(inputs), show_progress)
            self._waiting.append(request)
            self._stats["num_requests"] += 1
            self._has_work.notify()
        return future

    def score(self, query: str, documents: Sequence[str], *, truncate: bool = True,
              timeout: float | None = None, instruction: str | None = None) -> list[float]:
        """Relevance of each document to ``query`` from a cross-encoder, as sentence-transformers'
        ``CrossEncoder.predict`` gives it (its activation applied), or from an LLM reranker, the
        probability of "yes" (``instruction`` as in :meth:`submit_scores`); blocks. Pairs from
        every caller share the engine's batches.

        >>> with EmbeddingEngine(EmbeddingConfig(model="/models/ms-marco-MiniLM-L6-v2")) as reranker:
        ...     reranker.score("Where is Paris?", ["Paris is in France.", "Rome is in Italy."])
        [0.98..., 0.01...]
        >>> qwen = EmbeddingEngine(EmbeddingConfig(model="/models/Qwen3-Reranker-0.6B", task="score"))
        >>> qwen.score("Where is Paris?", ["Paris is in France."], instruction="Find the answer")
        """
        future = self.submit_scores(query, documents, truncate=truncate, instruction=instruction)
        try:
            return future.result(timeout)[:, 0].tolist()
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"scoring {len(documents)} documents did not finish within "
                               f"timeout={timeout} s") from None

    async def ascore(self, query: str, documents: Sequence[str], *, truncate: bool = True,
                     instruction: str | None = None) -> list[float]:
        """:meth:`score` for coroutines: the event loop waits, the engine thread computes."""
        future = self.submit_scores(query, documents, truncate=truncate, instruction=instruction)
        return (await asyncio.wrap_future(future))[:, 0].tolist()

    def embed(self, texts: Sequence[str], *, truncate: bool = True, show_progress: bool | None = None,
              timeout: float | None = None, prompt_name: str | None = None, prompt: str | None = None) -> torch.Tensor:
        """Embeddings of ``texts`` as a float32 tensor ``[len(texts), dimension]``; blocks.
        ``prompt_name``/``prompt`` as in :meth:`submit`."""
        future = self.submit(texts, truncate=truncate, show_progress=show_progress, prompt_name=prompt_name,
                             prompt=prompt)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"embedding {len(texts)} texts did not finish within timeout={timeout} s") from None

    def embed_one(self, text: str, *, truncate: bool = True, prompt_name: str | None = None,
                  prompt: str | None = None) -> torch.Tensor:
        """The embedding of one ``text``, ``[dimension]``; blocks."""
        _check_text(text, "text")
        return self.embed([text], truncate=truncate, show_progress=False, prompt_name=prompt_name, prompt=prompt)[0]

    async def aembed(self, texts: Sequence[str], *, truncate: bool = True, show_progress: bool | None = None,
                     prompt_name: str | None = None, prompt: str | None = None) -> torch.Tensor:
        """:meth:`embed` for coroutines: the event loop waits, the engine thread computes.
        Cancelling the awaiting task drops the texts not yet computed."""
        future = self.submit(texts, truncate=truncate, show_progress=show_progress, prompt_name=prompt_name,
                             prompt=prompt)
        return await asyncio.wrap_future(future)

    async def aembed_one(self, text: str, *, truncate: bool = True, prompt_name: str | None = None,
                         prompt: str | None = None) -> torch.Tensor:
        _check_text(text, "text")
        return (await self.aembed([text], truncate=truncate, show_progress=False, prompt_name=prompt_name,
                                  prompt=prompt))[0]

    def _progress_bar(self, num_texts: int, show_progress: bool | None) -> tqdm | None:
        if show_progress is None:
            show_progress = self.config.show_progress
        if show_progress or (show_progress is None and num_texts >= PROGRESS_MIN_TEXTS):
            return tqdm(total=num_texts, desc="Embedding", unit="text", dynamic_ncols=True)
        return None

    def stats(self) -> dict:
        """Counters since start: ``num_requests``, ``num_texts``, ``num_steps``, ``num_batches``
        (forward passes), ``num_tokens`` and ``num_padded_tokens`` (what the batches computed)."""
        with self._lock:
            return dict(self._stats, num_waiting_requests=len(self._waiting))

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self, wait: bool = True) -> None:
        """Start the engine thread; with ``wait`` block until the model is loaded (raises what loading raised)."""
        with self._lock:
            self._raise_if_stopped()
            self._start_locked()
        if wait:
            self._loaded_runner()

    @property
    def is_stopped(self) -> bool:
        return self._is_closing or self._stop_error is not None

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the thread and join it; waiting requests fail with :class:`EmbeddingEngineClosedError`."""
        with self._lock:
            self._is_closing = True
            self._has_work.notify()
            thread = self._thread
        if thread is None:
            self._stop(EmbeddingEngineClosedError("the embedding engine was closed"), None)
        elif thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the embedding engine thread for %s did not stop within %s s", self.spec.path, timeout)

    def __enter__(self) -> EmbeddingEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _start_locked(self) -> None:
        if self._thread is None:
            if self.num_workers > 1 or self._runs_on_gpu:   # batches run on the workers; see workers.py for why
                # both made on the caller's thread, whose thread count is the process's to keep
                self._workers = ForwardWorkers(self.num_workers, self.config.torch_device)
                self._thread = start_single_threaded(self._run, name="hearth-embeddings")
            else:
                self._thread = threading.Thread(target=self._run, name="hearth-embeddings", daemon=True)
                self._thread.start()

    def _raise_if_stopped(self) -> None:
        if self._stop_error is not None:
            error = type(self._stop_error)(*self._stop_error.args)
            raise error from self._stop_error.__cause__
        if self._is_closing:
            raise EmbeddingEngineClosedError("the embedding engine was closed")

    def _loaded_runner(self) -> EncoderRunner:
        with self._lock:
            self._raise_if_stopped()
            self._start_locked()
        self._loaded.wait()
        if self._runner is None:
            self._raise_if_stopped()
        return self._runner

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load_and_serve()
        finally:
            if self._workers is not None:
                self._workers.close()
                self._workers = None

    def _load_and_serve(self) -> None:
        try:
            self._runner = make_runner(self.spec, self.config)
            self._memory = _book_weights(self.config.torch_device, self.config.model, self._runner.model)
        except BaseException as error:  # noqa: BLE001 - every waiting caller must hear of it
            self._stop(EmbeddingEngineDeadError(f"loading the embedding model {self.spec.path} failed: "
                                                f"{type(error).__name__}: {error}"), error)
            return
        finally:
            self._loaded.set()
        try:
            with torch.inference_mode():
                # With workers, the next step is taken (and tokenized) while the last batches of
                # this one run, so that no core idles between steps.
                while (items := self._next_step(wait=not self._in_flight)) is not None:
                    if items:
                        self._run_step(items)
                    self._finish_batches(num_left=self._num_batches_ahead if items else 0)
        except BaseException as error:  # noqa: BLE001
            self._stop(EmbeddingEngineDeadError(f"the embedding engine thread crashed: {type(error).__name__}: "
                                                f"{error}"), error)
        else:
            self._stop(EmbeddingEngineClosedError("the embedding engine was closed"), None)

    def _next_step(self, wait: bool = True) -> list[_Item] | None:
        """Take each waiting request's fair share of one step; if none waits, wait for one (or
        return [] when not ``wait``). None: closing."""
        with self._lock:
            was_idle = False
            while True:
                self._waiting = deque(self._drop_finished(self._waiting))   # cancelled or failed
                if self._is_closing:
                    return None
                if self._waiting:
                    break
                if not wait:
                    return []
                self._has_work.wait()
                was_idle = True
            if was_idle:
                self._wait_for_burst_locked()
                if self._is_closing:
                    return None
            requests = list(self._waiting)
            budget = self.config.batch_size_limit * (1 if self._runs_on_gpu else BATCHES_PER_STEP * self.num_workers)
            shares = fair_shares([len(r.texts) - r.num_taken for r in requests], budget)
            items = []
            for request, share in zip(requests, shares, strict=True):
                items += [_Item(request, index) for index in range(request.num_taken, request.num_taken + share)]
                request.num_taken += share
            self._in_step = ([request for request in self._in_step if not request.is_finished]
                             + [request for request, share in zip(requests, shares, strict=True) if share])
            self._waiting = deque(r for r in self._waiting if r.num_taken < len(r.texts))
            self._stats["num_steps"] += 1
            return items

    def _wait_for_burst_locked(self) -> None:
        deadline = time.monotonic() + BURST_MAX_S
        num_seen = self._stats["num_requests"]
        while not self._is_closing and time.monotonic() < deadline:
            self._has_work.wait(BURST_QUIET_S)      # any submission wakes it early
            if self._stats["num_requests"] == num_seen:
                return
            num_seen = self._stats["num_requests"]

    def _run_step(self, items: list[_Item]) -> None:
        items = self._tokenize(items)
        lengths = [len(item.token_ids) for item in items]
        batches = [[items[i] for i in batch]
                   for batch in plan_batches(lengths, self.config.batch_token_budget, self.config.batch_size_limit,
                                             split_below=self._runner.float32_below_length)]
        self._num_step_batches = 0
        # a lone batch runs here, without a hand-off; on CUDA only when nothing else waits (a larger
        # request's next step is tokenized while its batch runs on the worker)
        is_alone = len(batches) == 1 and not self._in_flight and not (self._runs_on_gpu and self._waiting)
        if self._workers is None or is_alone:
            for batch in batches:
                self._run_batch(batch)
            return
        self._num_step_batches = len(batches)
        for batch in batches:   # longest first: the free worker takes the next, which balances them
            batch = self._drop_finished_items(batch)
            if batch:
                # on CUDA the worker only queues the batch and goes on to the next (runner.launch)
                forward = self._runner.launch if self._runs_on_gpu else self._runner.run
                future = self._workers.submit(forward, [item.token_ids for item in batch])
                self._in_flight[future] = batch

    @property
    def _num_batches_ahead(self) -> int:
        """Batches left running while the next step is taken and tokenized: one per CPU worker (each
        is a core); on CUDA the whole last step, so that the device works through it meanwhile."""
        return self._num_step_batches if self._runs_on_gpu else self.num_workers

    def _finish_batches(self, num_left: int) -> None:
        """Settle the workers' batches as they end, until at most ``num_left`` are in flight."""
        while len(self._in_flight) > num_left:
            if self._runs_on_gpu:
                # A GPU batch's future is done once queued (it holds PendingRows), and the device runs
                # them in order: settle the oldest, so as not to wait for newer ones before their turn.
                done = [next(iter(self._in_flight))]
            else:
                done, _ = concurrent.futures.wait(self._in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                self._finish_batch(self._in_flight.pop(future), lambda future=future: _rows(future.result()))

    def _tokenize(self, items: list[_Item]) -> list[_Item]:
        """Fill in token ids; fail requests that refuse truncation and have an over-long text, and
        requests with a text the tokenizer cannot read."""
        kept = []
        for truncate in (True, False):
            group = [item for item in items if item.request.truncate is truncate]
            if not group:
                continue
            try:
                token_ids, is_too_long = self._runner.tokenize([item.request.texts[item.index] for item in group],
                                                               truncate)
            except Exception:  # noqa: BLE001 - find the culprits one by one, serve the rest
                group, token_ids, is_too_long = self._tokenize_one_by_one(group, truncate)
            for item, ids, too_long in zip(group, token_ids, is_too_long, strict=True):
                if too_long and not truncate:
                    self._fail(item.request, TextTooLongError(
                        f"texts[{item.index}] has more than max_seq_length={self.max_seq_length} tokens; "
                        "shorten it, pass truncate=True, or raise max_seq_length"))
                item.token_ids = ids
                kept.append(item)
        return self._drop_finished_items(kept)

    def _tokenize_one_by_one(self, group: list[_Item], truncate: bool):
        readable, token_ids, is_too_long = [], [], []
        for item in group:
            try:
                (ids,), (too_long,) = self._runner.tokenize([item.request.texts[item.index]], truncate)
            except Exception as error:  # noqa: BLE001
                self._fail(item.request, ValueError(f"texts[{item.index}] cannot be tokenized: "
                                                    f"{type(error).__name__}: {error}"))
                continue
            readable.append(item)
            token_ids.append(ids)
            is_too_long.append(too_long)
        return readable, token_ids, is_too_long

    def _run_batch(self, batch: list[_Item]) -> None:
        batch = self._drop_finished_items(batch)
        if batch:
            self._finish_batch(batch, lambda: self._runner.run([item.token_ids for item in batch]))

    def _finish_batch(self, batch: list[_Item], forward: Callable[[], torch.Tensor]) -> None:
        """Hand each text its row of ``forward()``, or fail the batch's requests with what it raised."""
        try:
            embeddings = forward()
        except Exception as error:  # noqa: BLE001 - only this batch's requests fail
            logger.exception("an embedding batch failed")
            for request in {id(item.request): item.request for item in batch}.values():
                failure = EmbeddingFailedError(f"embedding failed: {type(error).__name__}: {error}")
                failure.__cause__ = error
                self._fail(request, failure)
            return
        self._stats["num_batches"] += 1
        self._stats["num_texts"] += len(batch)
        self._stats["num_tokens"] += sum(len(item.token_ids) for item in batch)
        self._stats["num_padded_tokens"] += len(batch) * max(len(item.token_ids) for item in batch)
        rows_of: dict[int, tuple[_Request, list[int], list[int]]] = {}   # request → (batch rows, its indices)
        for row, item in enumerate(batch):
            _, rows, indices = rows_of.setdefault(id(item.request), (item.request, [], []))
            rows.append(row)
            indices.append(item.index)
        for request, rows, indices in rows_of.values():   # one copy per request, not one per text
            request.embeddings.index_copy_(0, torch.tensor(indices), embeddings[rows])
            request.num_done += len(rows)
            self._advance(request, len(rows))

    def _advance(self, request: _Request, num_new: int) -> None:
        if request.progress is not None:
            request.progress.update(num_new)
        if request.num_done == len(request.texts):
            self._close_progress(request)
            _settle(request.future, result=request.embeddings)

    def _fail(self, request: _Request, error: BaseException) -> None:
        self._close_progress(request)
        _settle(request.future, error=error)

    def _drop_finished(self, requests) -> list[_Request]:
        """The requests still wanted; cancelled or failed ones lose their progress bar."""
        kept = []
        for request in requests:
            if request.is_finished:
                self._close_progress(request)
            else:
                kept.append(request)
        return kept

    def _drop_finished_items(self, items: list[_Item]) -> list[_Item]:
        wanted = {id(request) for request in self._drop_finished({id(i.request): i.request for i in items}.values())}
        return [item for item in items if id(item.request) in wanted]

    @staticmethod
    def _close_progress(request: _Request) -> None:
        if request.progress is not None:
            request.progress.close()
            request.progress = None

    def _stop(self, error: EmbeddingEngineDeadError, cause: BaseException | None) -> None:
        """Fail every waiting request with ``error``; later submissions raise it too."""
        error.__cause__ = cause
        with self._lock:
            if self._stop_error is None:
                self._stop_error = error
            waiting = self._in_step + list(self._waiting)
            self._in_step = []
            self._waiting.clear()
        for request in waiting:
            copy = type(error)(*error.args)
            copy.__cause__ = cause
            self._fail(request, copy)
        self._runner = None   # let the weights go
        if self._memory is not None:
            self._memory.release()
            self._memory = None


def _book_weights(device, model_name, model):
    """Book the weights in the device's memory budget, shared with the LLM engines of the process
    (they give back free KV blocks if needed); MemoryBudgetError if they do not fit."""
    from hearth_llm.engine.memory import book_weights

    return book_weights(device, f"embedding engine {os.path.basename(str(model_name))!r}", model)


def _rows(result) -> torch.Tensor:
    """A worker's result: the rows, or PendingRows (runner.launch) to wait for."""
    return result if isinstance(result, torch.Tensor) else result.wait()


def _settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Resolve unless the caller already cancelled."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _check_texts(texts: object, name: str) -> None:
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(f"{name} must be a list of str, got {type(texts).__name__}"
                        + (" (wrap a single text in a list)" if isinstance(texts, str) else ""))
    if len(texts) == 0:
        raise ValueError(f"{name} must be a non-empty list of str, got an empty {type(texts).__name__}")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{index}] must be a str, got {type(text).__name__}: {text!r:.80}")


def _check_text(text: object, name: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}: {text!r:.80}")


_live_engines: weakref.WeakSet[EmbeddingEngine] = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    for engine in list(_live_engines):
        engine.close(timeout=5.0)
