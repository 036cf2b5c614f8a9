"""``ReplicaOptions``: how many engine replicas serve one model, and where they run.

These options sit beside :class:`~..config.EngineConfig`, not in it: they say how many engines
there are and where, not what one engine computes, so every replica gets the same EngineConfig.
"""
from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("local", "ray")
# The keyword arguments of LLM / AsyncLLM / get_engine that are ReplicaOptions fields.
REPLICA_OPTION_NAMES = ("replicas", "backend", "ray_address", "max_load_gap", "max_restarts")


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """Replicas of one engine, each a Ray actor with its own KV cache.

    >>> ReplicaOptions(replicas=2, backend="ray")
    >>> AsyncLLM("default", replicas=2, backend="ray")   # the same, through any engine class

    - ``replicas``: engines serving the model; each request goes to one of them.
    - ``backend``: ``"local"`` (one engine in this process; ``replicas`` must be 1) or ``"ray"`` (one Ray actor
      per replica, each with a placement group of ``tensor_parallel_size`` GPUs on CUDA, or that many CPUs).
    - ``ray_address``: the cluster to join (``"ray://host:10001"``, ``"auto"``); None: the Ray this process
      already initialised, else a new local one.
    - ``max_load_gap``: a request leaves its prefix's replica for the least-loaded one when that replica
      has this many more outstanding sequences (:mod:`.router`); None: ``max_num_seqs // 4`` (at least 1).
    - ``max_restarts``: times Ray restarts a replica that died (its requests in flight fail with
      ``EngineDeadError`` either way); 0: a dead replica stays dead and the others serve.
    """

    replicas: int = 1
    backend: str = "local"
    ray_address: str | None = None
    max_load_gap: int | None = None
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be a positive int, got {self.replicas!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.backend == "local" and self.replicas > 1:
            raise ValueError(f"replicas={self.replicas} needs backend='ray' (one engine per Ray actor); the "
                             f"'local' backend runs one engine in this process")
        if self.backend == "local" and self.ray_address is not None:
            raise ValueError(f"ray_address={self.ray_address!r} needs backend='ray'")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address):
            raise ValueError(f"ray_address must be a non-empty str or None, got {self.ray_address!r}")
        if self.max_load_gap is not None and (isinstance(self.max_load_gap, bool)
                                              or not isinstance(self.max_load_gap, int) or self.max_load_gap < 1):
            raise ValueError(f"max_load_gap must be a positive int or None, got {self.max_load_gap!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")

    @property
    def is_distributed(self) -> bool:
        return self.backend == "ray"


def split_replica_options(engine_kwargs: dict) -> tuple[ReplicaOptions, dict]:
    """``(ReplicaOptions, the remaining EngineConfig keyword arguments)`` from a handle's keywords."""
    options = {name: engine_kwargs[name] for name in REPLICA_OPTION_NAMES if name in engine_kwargs}
    rest = {name: value for name, value in engine_kwargs.items() if name not in REPLICA_OPTION_NAMES}
    return ReplicaOptions(**options), rest
