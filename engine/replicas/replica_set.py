"""``ReplicaSet``: N engine replicas on Ray behind the :class:`~..engine_core.EngineCore` interface,
so ``LLM``, ``AsyncLLM``, ``ChatHearth`` and ``HearthLLM`` use them unchanged.

The process model::

    driver process                                        Ray actor per replica (its placement group)
    --------------                                        -------------------------------------------
    caller -> add_request -> RequestStream (returned)     EngineReplica
              |                                             add(batch) -> EngineCore.add_requests
              v  (the set's event-loop thread)              one task per request reads its stream
    tokenize + check (InputProcessor) -> router.route  ->   into the outbox
              |                                             poll() -> everything in the outbox
    one pump per replica: await poll() -> stream.put  <-    (one Ray call per engine step, all requests)

Abort: a stream closed by its reader sends ``abort`` to its replica; the replica's engine frees the
blocks before its next step and answers with the request's last (``"abort"``) output.
A replica that dies fails its requests in flight with :class:`EngineDeadError`; the router stops
sending it requests; with ``max_restarts`` it comes back once Ray restarted it (cache empty).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from ..config import EngineConfig
from ..core_front import CoreFront, check_requests, deliver, is_last_item
from ..errors import EngineClosedError, EngineDeadError, EngineOverloadedError
from ..input_processor import BatchRejectedError, InputProcessor, RequestInput
from ..outputs import StreamOutput
from ..streams import RequestStream
from . import ray_cluster
from .options import ReplicaOptions
from .replica_actor import ReplicaFacts
from .router import PrefixAffinityRouter, Route

logger = logging.getLogger("hearth_llm")

# Seconds between two checks whether a dead replica has been restarted by Ray.
RESTART_PROBE_S = 0.5
# Seconds Ray may take to restart a dead replica and the replica to load its model again.
RESTART_TIMEOUT_S = 300.0
# Seconds a stats() call waits for each replica's counters.
STATS_TIMEOUT_S = 10.0
# Counters of the replicas that stats() reports as their maximum rather than their sum.
_MAX_NOT_SUM = frozenset({"max_num_scheduled_requests"})


@dataclass(slots=True, eq=False)
class _Pending:
    """A request from ``add_requests`` to its last output: its stream, then where it went."""

    input: RequestInput
    stream: RequestStream
    route: Route | None = None
    is_aborted: bool = False  # its reader left before it was sent


@dataclass(slots=True)
class _Replica:
    handle: ray_cluster.ReplicaHandle
    facts: ReplicaFacts | None = None
    pump: asyncio.Task | None = None
    num_restarts: int = 0
    last_error: str | None = None
    pending: dict[str, _Pending] = field(default_factory=dict)


class ReplicaSet(CoreFront):
    """``options.replicas`` engines of one model, each a Ray actor; requests are routed by
    prefix-cache affinity with least-outstanding fallback (:mod:`.router`).

    >>> llm = AsyncLLM("default", replicas=2, backend="ray")      # or LLM(...), ChatHearth(..., replicas=2, ...)
    >>> async for out in llm.generate("Hello", SamplingParams(max_tokens=8)):
    ...     print(out.delta_text, end="")
    >>> llm.stats()["replicas"][0]["num_affine_routed"]

    Made by :func:`~..registry.get_engine` for ``backend="ray"``; cheap until the first request
    (or ``wait_until_started``), which joins Ray and starts the replicas.
    """

    def __init__(self, config: EngineConfig, options: ReplicaOptions, engine_kwargs: dict, on_stop=None):
        self.config = config
        self.options = options
        self._engine_kwargs = dict(engine_kwargs)
        self._on_stop = on_stop
        self._lock = threading.Lock()
        self._num_handles = 0
        self._is_closing = False
        self._stop_error: EngineDeadError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._startup: Future | None = None  # resolves when every replica has loaded
        self._started_ray = False
        self._replicas: list[_Replica] = []
        self._router: PrefixAffinityRouter | None = None
        self._processor: InputProcessor | None = None
        self._facts: ReplicaFacts | None = None
        self._pending: dict[str, _Pending] = {}  # every request not finished yet, by id

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start joining Ray and loading the replicas (in the background) unless begun; returns at once."""
        with self._lock:
            self._raise_if_stopped()
            self._start_locked()

    def wait_until_started(self, timeout: float | None = None) -> None:
        """Block until every replica has loaded the model; raises what starting raised."""
        self.start()
        try:
            self._startup.result(timeout)
        except TimeoutError:
            raise TimeoutError(f"the replicas of {self.config.model!r} did not start within {timeout} s") from None
        self._raise_if_stopped()

    @property
    def engine(self) -> ReplicaFacts:
        """Read-only model facts (``tokenizer``, ``hf_config``, ``max_model_len``) from replica 0;
        the engines themselves live in the replicas."""
        self.wait_until_started()
        return self._facts

    @property
    def model_info(self):
        return self.engine.model_info

    @property
    def is_sleeping(self) -> bool:
        return bool(self.stats().get("is_sleeping"))

    @property
    def keep_alive(self) -> float | None:
        return self.config.keep_alive

    @property
    def num_replicas(self) -> int:
        return self.options.replicas

    def replica_actor(self, index: int):
        """The Ray actor handle of replica ``index`` (to inspect it, or ``ray.kill`` it in a test)."""
        self.wait_until_started()
        return self._replicas[index].handle.actor

    def replica_of(self, request_id: str) -> int | None:
        """The replica serving a request in flight (None: finished, unknown, or not routed yet)."""
        with self._lock:
            pending = self._pending.get(str(request_id))
            return pending.route.replica if pending is not None and pending.route is not None else None

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop every replica; pending requests raise :class:`EngineClosedError`."""
        with self._lock:
            if self._is_closing:
                return
            self._is_closing = True
            loop, startup = self._loop, self._startup
        if startup is not None:
            try:
                startup.result(timeout)  # a half-started set is torn down whole
            except BaseException:  # noqa: BLE001 - it failed: _stop already ran
                pass
        for replica in self._replicas:
            ray_cluster.stop_replica(replica.handle)
        self._stop(EngineClosedError("the engine was closed"))
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._loop_thread.join(timeout)
        ray_cluster.leave_cluster(self._started_ray)
        self._started_ray = False

    # ---- requests ----------------------------------------------------------------------------

    def add_requests(self, prompts, sampling_params, request_ids=None, priorities=None, cache_salt=None,
                     timeout=None, lora_requests=None) -> list[RequestStream]:
        """As :meth:`EngineCore.add_requests`: all prompts admitted, or (one invalid) none."""
        inputs = check_requests(prompts, sampling_params, request_ids, priorities, cache_salt, timeout, lora_requests)
        pendings = [_Pending(checked, self._make_stream(checked.request_id, timeout)) for checked in inputs]
        with self._lock:
            self._raise_if_stopped()
            self._check_overload(sum(p.input.sampling_params.n for p in pendings))
            rejected = self._id_in_use(pendings)
            if rejected is not None:  # as one engine does: the whole batch fails, through its streams
                for index, pending in enumerate(pendings):
                    pending.stream.put(rejected.error_for(index))
                return [pending.stream for pending in pendings]
            for pending in pendings:
                self._pending[pending.input.request_id] = pending  # in flight (and abortable) from now on
            self._start_locked()
            # The loop thread may not run yet: the batch waits for the startup future there.
            self._loop.call_soon_threadsafe(self._submit_soon, pendings, cache_salt, timeout)
        return [pending.stream for pending in pendings]

    def abort(self, request_id: str) -> None:
        """Abort a request on its replica; unknown or finished ids are ignored."""
        with self._lock:
            pending = self._pending.get(str(request_id))
        if pending is not None:
            self._abort_pending(pending)

    def stats(self) -> dict:
        """The replicas' engine counters summed (``max_num_scheduled_requests``: their maximum; flags such
        as ``is_sleeping``: true when true of every live replica), and
        ``replicas``: per replica its router counters (``num_outstanding``, ``num_routed``,
        ``num_affine_routed``, ``num_fallback_routed``, ``is_alive``) and its own engine counters."""
        if self._startup is None or not self._startup.done() or self._router is None:
            return {"num_replicas": self.options.replicas, "num_live_replicas": 0, "replicas": [],
                    "num_queued": len(self._pending)}
        per_replica = self._replica_stats()
        total = _sum_counters([entry for entry in per_replica if entry["is_alive"]])
        total.update(num_replicas=self.options.replicas, replicas=per_replica,
                     num_live_replicas=sum(entry["is_alive"] for entry in per_replica))
        return total

    def sleep(self, level: int = 1, timeout: float | None = None) -> None:
        """Put every live replica to sleep (see :meth:`EngineCore.sleep`)."""
        self._on_live_replicas("sleep", timeout, level)

    def wake_up(self, timeout: float | None = None) -> None:
        self._on_live_replicas("wake_up", timeout)

    def set_keep_alive(self, keep_alive, sleep_level: int | None = None) -> None:
        from ..config import parse_seconds

        self._on_live_replicas("set_keep_alive", STATS_TIMEOUT_S, parse_seconds("keep_alive", keep_alive),
                               sleep_level)

    # ---- caller side helpers -----------------------------------------------------------------

    def _check_overload(self, num_sequences: int) -> None:
        # Each replica bounds its own waiting queue; this bound keeps the driver's backlog (requests
        # not yet answered) within the same total before anything crosses the network.
        bound = self.options.replicas * (self.config.max_waiting_requests + self.config.max_num_seqs)
        in_flight = sum(p.input.sampling_params.n for p in self._pending.values())
        if in_flight + num_sequences > bound:
            raise EngineOverloadedError(
                f"{in_flight} sequences are in flight on {self.options.replicas} replicas, {num_sequences} more "
                f"would pass replicas x (max_waiting_requests + max_num_seqs) = {bound}; retry later")
        # counted as in flight from now on (the loop thread routes them)

    def _id_in_use(self, pendings: list[_Pending]) -> BatchRejectedError | None:
        seen = set()
        for index, pending in enumerate(pendings):
            request_id = pending.input.request_id
            if request_id in self._pending or request_id in seen:
                return BatchRejectedError(index, ValueError(f"request_id {request_id!r} is already in use"))
            seen.add(request_id)
        return None

    def _abort_stream(self, stream: RequestStream) -> None:
        with self._lock:
            pending = self._pending.get(stream.request_id)
        if pending is not None and pending.stream is stream:
            self._abort_pending(pending)

    def _abort_pending(self, pending: _Pending) -> None:
        with self._lock:  # see _route_and_send: the add is submitted before this abort, or never
            if pending.route is None:
                pending.is_aborted = True  # not sent yet: _route_and_send drops it
                return
            try:
                self._replicas[pending.route.replica].handle.actor.abort.remote(pending.input.request_id)
            except Exception:  # noqa: BLE001 - the replica is gone: its pump fails the request
                pass

    def _is_serving(self) -> bool:
        return not self.is_stopped and self._loop_thread is not None and self._loop_thread.is_alive()

    def _start_locked(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.new_event_loop()
        self._startup = Future()
        name = f"hearth-replicas-{str(self.config.model).rsplit('/', 1)[-1]}"
        self._loop_thread = threading.Thread(target=self._run_loop, name=name, daemon=True)
        self._loop_thread.start()

    def _on_live_replicas(self, method: str, timeout: float | None, *args) -> None:
        self.wait_until_started()
        ray = ray_cluster.import_ray()
        refs = [getattr(r.handle.actor, method).remote(*args) for r in self._replicas
                if self._router.is_alive(r.handle.index)]
        ray.get(refs, timeout=timeout)

    def _replica_stats(self) -> list[dict]:
        ray = ray_cluster.import_ray()
        per_replica = []
        refs = {r.handle.index: r.handle.actor.stats.remote() for r in self._replicas
                if self._router.is_alive(r.handle.index)}
        for replica in self._replicas:
            index = replica.handle.index
            entry = {"replica": index, **self._router.stats(index), "num_restarts": replica.num_restarts,
                     "last_error": replica.last_error,
                     "pid": replica.facts.pid if replica.facts else None,
                     "node_id": replica.facts.node_id if replica.facts else None}
            if index in refs:
                try:
                    entry.update(ray.get(refs[index], timeout=STATS_TIMEOUT_S))
                except Exception as error:  # noqa: BLE001 - dying right now: its pump will say so
                    entry["last_error"] = f"{type(error).__name__}: {error}"
            per_replica.append(entry)
        return per_replica

    # ---- the set's event-loop thread ---------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.create_task(self._start_replicas())
        try:
            self._loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _start_replicas(self) -> None:
        try:
            await asyncio.to_thread(self._start_replicas_blocking)
        except BaseException as error:  # noqa: BLE001 - every caller must hear of it
            logger.exception("the replicas of %r failed to start", self.config.model)
            self._stop(EngineDeadError(f"the replicas of {self.config.model!r} failed to start: "
                                       f"{type(error).__name__}: {error}"), error)
            self._startup.set_exception(_copy(self._stop_error))
            return
        for replica in self._replicas:
            replica.pump = asyncio.get_running_loop().create_task(self._pump(replica))
        self._startup.set_result(None)

    def _start_replicas_blocking(self) -> None:
        ray = ray_cluster.import_ray()
        self._started_ray = ray_cluster.join_cluster(self.options.ray_address)
        bundle = ray_cluster.replica_bundle(self.config, ray_cluster.cluster_gpus())
        kwargs = {"show_progress": False, **self._engine_kwargs}
        if self.config.device == "auto" or bundle.device == "cuda":
            # the bundle decided; a replica does not guess again, and its GPUs are numbered from 0
            # (Ray sets CUDA_VISIBLE_DEVICES to them), so "cuda:1" would name one it does not have
            kwargs["device"] = bundle.device
        if bundle.device == "cpu" and "num_threads" not in self._engine_kwargs:
            kwargs["num_threads"] = bundle.num_cpus  # the replica's share of the cores, not the driver's count
        prefix = f"hearth-{str(self.config.model).rstrip('/').rsplit('/', 1)[-1]}-{uuid.uuid4().hex[:8]}"
        for index in range(self.options.replicas):
            handle = ray_cluster.start_replica(index, self.config.model, kwargs, bundle, self.options.max_restarts,
                                               f"{prefix}-{index}")
            self._replicas.append(_Replica(handle))
            if self._is_closing:
                raise EngineClosedError("the engine was closed while its replicas started")
        facts = ray.get([replica.handle.actor.start.remote() for replica in self._replicas])
        for replica, replica_facts in zip(self._replicas, facts):
            replica.facts = replica_facts
        self._facts = facts[0]
        info = self._facts.model_info
        self._processor = InputProcessor(self._facts.tokenizer, info.vocab_size, info.max_model_len,
                                         info.eos_token_ids, self.config.enable_prefix_caching)
        gap = self.options.max_load_gap or max(1, self.config.max_num_seqs // 4)
        self._router = PrefixAffinityRouter(self.options.replicas, self.config.block_size, max_load_gap=gap)

    def _submit_soon(self, pendings: list[_Pending], cache_salt, timeout) -> None:
        self._loop.create_task(self._submit(pendings, cache_salt, timeout))

    async def _submit(self, pendings: list[_Pending], cache_salt, timeout) -> None:
        """Check and tokenize the batch here (all or none, as one engine would), then route each
        request and send each replica its share in one call."""
        try:
            await asyncio.wrap_future(self._startup)
            samples = self._check(pendings)
            self._route_and_send(pendings, samples, cache_salt, timeout)
        except Exception as error:  # noqa: BLE001 - the batch is refused or the set is dead
            for index, pending in enumerate(pendings):
                self._finish(pending, error.error_for(index) if isinstance(error, BatchRejectedError) else _copy(error))

    def _check(self, pendings: list[_Pending]) -> list[list]:
        """Each request's samples (their token ids) as the replica's engine will see them, or
        ``BatchRejectedError``. LoRA adapters are checked by the replica that loads them."""
        # ids in use were refused by add_requests already
        return self._processor.process([replace(p.input, lora_request=None) for p in pendings], ())

    def _route_and_send(self, pendings: list[_Pending], samples: list[list], cache_salt, timeout) -> None:
        # Under the lock: an abort either finds no route (and the request is dropped here) or finds
        # one whose add was submitted before it, so the replica sees add, then abort.
        batches: dict[int, list[tuple]] = {}
        with self._lock:
            for pending, children in zip(pendings, samples):
                checked = pending.input
                if pending.is_aborted:  # aborted before it was sent: it ends here, as one engine would end it
                    self._pending.pop(checked.request_id, None)
                    pending.stream.put(StreamOutput(checked.request_id, "", [], finish_reason="abort", finished=True))
                    continue
                lora = checked.lora_request
                extra_key = None if cache_salt is None and lora is None else \
                    json.dumps([cache_salt, lora.name if lora is not None else None])
                pending.route = self._router.route(children[0].prompt_token_ids, extra_key, len(children))
                self._replicas[pending.route.replica].pending[checked.request_id] = pending
                batches.setdefault(pending.route.replica, []).append(
                    (checked.request_id, checked.prompt, checked.sampling_params, checked.priority, lora))
            for index, batch in batches.items():
                self._replicas[index].handle.actor.add.remote(batch, cache_salt, timeout)

    async def _pump(self, replica: _Replica) -> None:
        """Carry one replica's outputs to their streams until it dies or the set closes."""
        errors = ray_cluster.actor_errors()
        while not self._is_closing:
            try:
                batch = await replica.handle.actor.poll.remote()
            except errors as error:
                if not self._is_closing:  # close() kills the actors: that is no death to report
                    self._replica_died(replica, error)
                return
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - e.g. an output that did not unpickle: keep serving
                logger.exception("replica %d of %r: a poll failed", replica.handle.index, self.config.model)
                replica.last_error = f"{type(error).__name__}: {error}"
                await asyncio.sleep(0.1)
                continue
            for request_id, item in batch:
                self._deliver(replica, request_id, item)

    def _deliver(self, replica: _Replica, request_id: str, item) -> None:
        pending = replica.pending.get(request_id)
        if pending is None:
            return  # finished already (its abort's last output, after an error)
        if is_last_item(item):
            self._finish(pending, item)
            if isinstance(item, EngineDeadError) and not isinstance(item, EngineClosedError) and not self._is_closing:
                # the engine loop inside the actor died, the actor lives on: end the actor, so its
                # other requests fail now and Ray restarts it (max_restarts) or it stays dead
                ray_cluster.import_ray().kill(replica.handle.actor, no_restart=False)
        else:
            deliver(pending.stream, item, self._abort_stream)  # aborts it when its reader's event loop is gone

    def _finish(self, pending: _Pending, item) -> None:
        """The request's last output or error: forget it everywhere, then hand it over."""
        request_id = pending.input.request_id
        with self._lock:
            if self._pending.get(request_id) is pending:
                del self._pending[request_id]
            if pending.route is not None:
                self._replicas[pending.route.replica].pending.pop(request_id, None)
                self._router.finish(pending.route)
        pending.stream.put(item)

    def _replica_died(self, replica: _Replica, error: BaseException) -> None:
        index = replica.handle.index
        replica.last_error = f"{type(error).__name__}: {error}"
        logger.error("replica %d of %r died: %s", index, self.config.model, replica.last_error)
        self._router.mark_dead(index)
        dead = EngineDeadError(f"replica {index} of model {self.config.model!r} died while serving this request: "
                               f"{type(error).__name__}")
        dead.__cause__ = error
        for pending in list(replica.pending.values()):
            self._finish(pending, _copy(dead))
        if ray_cluster.is_restarting(error):
            asyncio.get_running_loop().create_task(self._await_restart(replica))
            return
        # dead for good: give its bundle back to the cluster
        asyncio.get_running_loop().run_in_executor(None, ray_cluster.stop_replica, replica.handle, 0.0)
        if not self._router.live_replicas:
            self._stop(EngineDeadError(f"all {self.options.replicas} replicas of {self.config.model!r} are dead"),
                       error)

    async def _await_restart(self, replica: _Replica) -> None:
        """Ray restarts the actor (``max_restarts``): once the new one has loaded the model, it
        serves again (its prefix cache empty). Dead for good instead: its bundle is given back."""
        errors = ray_cluster.actor_errors()
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        old_pid = replica.facts.pid if replica.facts else None
        while not self._is_closing:
            await asyncio.sleep(RESTART_PROBE_S)
            try:
                facts = await replica.handle.actor.start.remote()
            except errors as error:
                replica.last_error = f"{type(error).__name__}: {error}"
                if ray_cluster.is_restarting(error) and time.monotonic() < deadline:
                    continue
                logger.error("replica %d of %r did not come back: %s", replica.handle.index, self.config.model,
                             replica.last_error)
                await asyncio.to_thread(ray_cluster.stop_replica, replica.handle, 0.0)
                if not self._router.live_replicas:
                    self._stop(EngineDeadError(f"all {self.options.replicas} replicas of {self.config.model!r} "
                                               f"are dead"), error)
                return
            replica.facts = facts
            replica.num_restarts += facts.pid != old_pid  # the same pid: it was only unreachable a moment
            self._router.mark_alive(replica.handle.index)
            replica.pump = asyncio.get_running_loop().create_task(self._pump(replica))
            logger.info("replica %d of %r serves again (restarts: %d)", replica.handle.index, self.config.model,
                        replica.num_restarts)
            return

    def _stop(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        """Fail every pending request with ``error``; later calls raise it too."""
        if cause is not None:
            error.__cause__ = cause
        with self._lock:
            if self._stop_error is None:
                self._stop_error = error
            pendings = list(self._pending.values())
            self._pending.clear()
        for replica in self._replicas:
            replica.pending.clear()
        for pending in pendings:
            pending.stream.put(_copy(error))
        if self._on_stop is not None:
            self._on_stop(self)


def _copy(error: BaseException) -> BaseException:
    """A fresh exception per stream, with the original as its cause."""
    try:
        copy = type(error)(*error.args)
    except Exception:  # noqa: BLE001 - an exception type with another signature
        copy = RuntimeError(str(error))
    copy.__cause__ = error.__cause__ or error
    return copy


def _sum_counters(entries: list[dict]) -> dict:
    total: dict = {}
    for entry in entries:
        for key, value in entry.items():
            if key in ("replica", "pid", "node_id", "last_error", "is_alive") or isinstance(value, (str, type(None))):
                continue
            if isinstance(value, bool):  # is_sleeping: the set sleeps when all its replicas do
                total[key] = total.get(key, True) and value
            elif isinstance(value, (int, float)):
                total[key] = max(total.get(key, value), value) if key in _MAX_NOT_SUM else total.get(key, 0) + value
    return total
