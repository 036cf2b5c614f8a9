"""Engine replicas on Ray (``hearth-llm[ray]``): ``AsyncLLM(model, replicas=N, backend="ray")``.

- :mod:`.options`: ``ReplicaOptions`` (``replicas``, ``backend``, ``ray_address``, ...), beside ``EngineConfig``.
- :mod:`.router`: ``PrefixAffinityRouter``, which replica serves a request (no Ray needed).
- :mod:`.replica_actor`: ``EngineReplica``, one ``EngineCore`` inside a Ray actor.
- :mod:`.ray_cluster`: joining Ray, placement groups, starting and stopping the actors.
- :mod:`.replica_set`: ``ReplicaSet``, the replicas behind ``EngineCore``'s interface (the driver side).

Only ``ray_cluster`` imports Ray, and only when a replica set starts.
"""
from .options import ReplicaOptions
from .router import PrefixAffinityRouter, Route

__all__ = ["ReplicaOptions", "PrefixAffinityRouter", "Route"]
