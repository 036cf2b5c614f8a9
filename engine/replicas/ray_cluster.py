"""Everything that touches Ray's API: joining a cluster, reserving each replica's placement group,
starting the replica actors and taking them down. Ray is imported here only (``hearth-llm[ray]``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from ..config import EngineConfig

# A replica whose placement group is not ready by then has no room in the cluster.
PLACEMENT_TIMEOUT_S = 120.0

_lock = threading.Lock()
_num_users_of_our_ray = 0  # replica sets alive on a Ray this module started (it stops with the last)


def import_ray():
    """The ``ray`` module, or an ImportError that says how to get it."""
    try:
        import ray
    except ImportError as error:
        raise ImportError("backend='ray' needs Ray: pip install 'hearth-llm[ray]' (or pip install ray)") from error
    return ray


def join_cluster(address: str | None) -> bool:
    """Use the Ray this process initialised, or join ``address``, or start a local Ray (None).
    True when this call started or joined it (``leave_cluster`` then shuts it down with its last user)."""
    global _num_users_of_our_ray
    ray = import_ray()
    with _lock:
        if ray.is_initialized():
            if _num_users_of_our_ray:
                _num_users_of_our_ray += 1
                return True
            return False
        ray.init(address=address, include_dashboard=False)
        _num_users_of_our_ray = 1
        return True


def leave_cluster(started_it: bool) -> None:
    global _num_users_of_our_ray
    if not started_it:
        return
    ray = import_ray()
    with _lock:
        _num_users_of_our_ray = max(0, _num_users_of_our_ray - 1)
        if _num_users_of_our_ray == 0 and ray.is_initialized():
            ray.shutdown()


@dataclass(frozen=True, slots=True)
class ReplicaBundle:
    """The resources one replica reserves: ``num_gpus`` (its tensor-parallel GPUs) and ``num_cpus``."""

    num_cpus: int
    num_gpus: int

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus else "cpu"

    def as_ray_bundle(self) -> dict:
        return {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {})}


def replica_bundle(config: EngineConfig, cluster_gpus: float) -> ReplicaBundle:
    """One GPU per tensor-parallel rank (and a CPU for the engine loop) on CUDA, or one CPU per rank.
    ``device="auto"`` picks CUDA when the cluster has the GPUs for one replica, not by this machine's."""
    ranks = config.tensor_parallel_size
    wants_cuda = str(config.device).startswith("cuda") or (config.device == "auto" and cluster_gpus >= ranks)
    return ReplicaBundle(num_cpus=1, num_gpus=ranks) if wants_cuda else ReplicaBundle(num_cpus=ranks, num_gpus=0)


def cluster_gpus() -> float:
    return float(import_ray().cluster_resources().get("GPU", 0))


@dataclass(slots=True)
class ReplicaHandle:
    """One started replica: its actor and the placement group it runs in."""

    index: int
    actor: object
    placement_group: object


def start_replica(index: int, model: str, engine_kwargs: dict, bundle: ReplicaBundle, max_restarts: int,
                  name: str) -> ReplicaHandle:
    """Reserve the replica's bundle (one node: its TP workers are its child processes), then start
    its actor in it. The model loads at the actor's ``start()``."""
    ray = import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from .replica_actor import EngineReplica

    group = placement_group([bundle.as_ray_bundle()], strategy="STRICT_PACK", name=f"{name}-pg")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - GetTimeoutError and friends: say what was asked for
        _remove_group(group)
        raise RuntimeError(f"replica {index}: the cluster has no room for {bundle.as_ray_bundle()} within "
                           f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster: {ray.cluster_resources()})") from error
    actor_class = ray.remote(EngineReplica)
    actor = actor_class.options(
        name=name, num_cpus=bundle.num_cpus, num_gpus=bundle.num_gpus, max_restarts=max_restarts,
        max_task_retries=0,  # a request in flight on a dead replica fails; it is not re-run blindly
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                             placement_group_capture_child_tasks=True),
    ).remote(model, engine_kwargs)
    return ReplicaHandle(index, actor, group)


def stop_replica(handle: ReplicaHandle, timeout_s: float = 10.0) -> None:
    """Close the replica's engine (politely, for ``timeout_s``), kill the actor, free its bundle."""
    ray = import_ray()
    if not ray.is_initialized():
        return  # Ray went first (interpreter exit): its actors are gone with it
    try:
        ray.get(handle.actor.close.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - dead or stuck: killed below either way
        pass
    try:
        ray.kill(handle.actor, no_restart=True)
    except Exception:  # noqa: BLE001
        pass
    _remove_group(handle.placement_group)


def _remove_group(group) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001 - already gone
        pass


def actor_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "this actor is dead or unreachable"."""
    exceptions = import_ray().exceptions
    return tuple(getattr(exceptions, name) for name in ("RayActorError", "ActorUnavailableError", "ActorDiedError")
                 if hasattr(exceptions, name))


def is_restarting(error: BaseException) -> bool:
    """Whether Ray says the actor may come back (it is being restarted, or briefly unreachable);
    otherwise (``ActorDiedError``) it is dead for good."""
    unavailable = getattr(import_ray().exceptions, "ActorUnavailableError", None)
    return unavailable is not None and isinstance(error, unavailable)
