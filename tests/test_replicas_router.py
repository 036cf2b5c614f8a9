"""The replica router's rule, without Ray: prefix-cache affinity by the prompt's first blocks,
least-outstanding fallback when the affine replica is overloaded, dead replicas skipped; and the
replica options' checks."""
from __future__ import annotations

import pytest

from hearth_llm.engine import EngineDeadError
from hearth_llm.engine.replicas import PrefixAffinityRouter, ReplicaOptions
from hearth_llm.engine.replicas.options import split_replica_options

BLOCK = 4


def prompt(prefix: int, suffix: int, num_prefix_blocks: int = 2) -> list[int]:
    """``num_prefix_blocks`` full blocks shared by every prompt of ``prefix``, then a distinct tail."""
    return [prefix * 100 + i for i in range(num_prefix_blocks * BLOCK)] + [suffix, suffix + 1]


def test_requests_sharing_a_prefix_follow_the_first_one():
    router = PrefixAffinityRouter(num_replicas=3, block_size=BLOCK, max_load_gap=10)
    first = router.route(prompt(1, 0))
    later = [router.route(prompt(1, suffix)) for suffix in range(1, 5)]
    assert {route.replica for route in later} == {first.replica}
    assert all(route.is_affine and route.num_matched_blocks == 2 for route in later)


def test_new_prefixes_spread_to_the_least_loaded_replicas():
    router = PrefixAffinityRouter(num_replicas=3, block_size=BLOCK, max_load_gap=10)
    routes = [router.route(prompt(prefix, 0)) for prefix in range(3)]
    assert sorted(route.replica for route in routes) == [0, 1, 2]
    assert not any(route.is_affine for route in routes)


def test_the_longest_known_prefix_decides():
    router = PrefixAffinityRouter(num_replicas=2, block_size=BLOCK, max_load_gap=1)
    deep = router.route(prompt(8, 0, num_prefix_blocks=3))        # replica 0 holds 3 blocks of prefix 8
    shallow = router.route(prompt(8, 1, num_prefix_blocks=1))     # overloaded 0 -> 1, which now owns block 1
    for route in (deep, shallow):
        router.finish(route)
    assert (deep.replica, shallow.replica) == (0, 1)
    again = router.route(prompt(8, 2, num_prefix_blocks=3))
    assert again.replica == 0 and again.is_affine and again.num_matched_blocks == 3


def test_an_overloaded_affine_replica_falls_back_to_the_least_loaded():
    router = PrefixAffinityRouter(num_replicas=2, block_size=BLOCK, max_load_gap=2)
    routes = [router.route(prompt(1, suffix)) for suffix in range(3)]
    # replica 0 takes two; at a gap of 2 outstanding the third goes to replica 1
    assert [route.replica for route in routes] == [0, 0, 1]
    assert routes[2].is_affine is False
    assert router.stats(1)["num_fallback_routed"] == 1
    # replica 1 now holds the prefix too, and is the least loaded: it keeps getting it
    assert router.route(prompt(1, 9)).replica == 1


def test_finished_requests_no_longer_count_as_load():
    router = PrefixAffinityRouter(num_replicas=2, block_size=BLOCK, max_load_gap=2)
    routes = [router.route(prompt(1, suffix)) for suffix in range(2)]
    for route in routes:
        router.finish(route)
    assert router.stats(0)["num_outstanding"] == 0
    assert router.route(prompt(1, 7)).replica == 0  # affine again: the load is gone


def test_samples_count_as_load_each():
    router = PrefixAffinityRouter(num_replicas=2, block_size=BLOCK, max_load_gap=4)
    router.route(prompt(1, 0), num_sequences=4)
    assert router.stats(0)["num_outstanding"] == 4
    assert router.route(prompt(1, 1)).replica == 1  # 4 - 0 >= max_load_gap


def test_salt_or_adapter_separates_otherwise_equal_prefixes():
    router = PrefixAffinityRouter(num_replicas=2, block_size=BLOCK, max_load_gap=10)
    plain = router.route(prompt(1, 0))
    salted = router.route(prompt(1, 0), extra_key="tenant-a")
    assert not salted.is_affine and salted.replica != plain.replica


def test_prompts_shorter_than_a_block_go_by_load_alone():
    router = PrefixAffinityRouter(num_replicas=2, block_size=BLOCK, max_load_gap=10)
    assert [router.route([1, 2, 3]).replica for _ in range(2)] == [0, 1]


def test_only_the_first_max_prefix_blocks_are_hashed():
    router = PrefixAffinityRouter(num_replicas=2, block_size=BLOCK, max_prefix_blocks=2)
    assert len(router.prefix_hashes(list(range(10 * BLOCK)))) == 2
    assert router.prefix_hashes(list(range(8)))[0] == router.prefix_hashes(list(range(4)) + [50] * 4)[0]


def test_dead_replicas_get_nothing_and_lose_their_prefixes():
    router = PrefixAffinityRouter(num_replicas=2, block_size=BLOCK, max_load_gap=10)
    first = router.route(prompt(1, 0))
    router.mark_dead(first.replica)
    survivor = router.route(prompt(1, 1))
    assert survivor.replica != first.replica and not survivor.is_affine
    router.mark_dead(survivor.replica)
    with pytest.raises(EngineDeadError, match="all 2 replicas are dead"):
        router.route(prompt(1, 2))
    router.mark_alive(first.replica)
    assert router.route(prompt(1, 3)).replica == first.replica


def test_the_table_forgets_the_oldest_prefixes():
    router = PrefixAffinityRouter(num_replicas=2, block_size=BLOCK, max_load_gap=100, max_prefix_blocks=1,
                                  table_size=2)
    router.route(prompt(1, 0))
    router.route(prompt(2, 0))
    router.route(prompt(3, 0))  # prefix 1 falls out of the table
    assert not router.route(prompt(1, 5)).is_affine
    assert router.route(prompt(3, 5)).is_affine


@pytest.mark.parametrize("name, value", [("num_replicas", 0), ("block_size", -1), ("max_load_gap", 0),
                                         ("max_prefix_blocks", 1.5), ("table_size", True)])
def test_router_arguments_are_checked(name, value):
    kwargs = dict(num_replicas=2, block_size=BLOCK, max_load_gap=2, max_prefix_blocks=4, table_size=8)
    with pytest.raises(ValueError, match=name):
        PrefixAffinityRouter(**{**kwargs, name: value})


@pytest.mark.parametrize("kwargs, message", [
    (dict(replicas=0), "replicas must be a positive int"),
    (dict(replicas=2), "replicas=2 needs backend='ray'"),
    (dict(backend="dask"), "backend must be one of"),
    (dict(backend="local", ray_address="auto"), "ray_address='auto' needs backend='ray'"),
    (dict(backend="ray", ray_address=""), "ray_address must be a non-empty str"),
    (dict(backend="ray", max_load_gap=0), "max_load_gap must be a positive int"),
    (dict(backend="ray", max_restarts=-1), "max_restarts must be an int >= 0"),
])
def test_replica_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplicaOptions(**kwargs)


def test_replica_options_are_split_from_engine_options():
    options, rest = split_replica_options({"replicas": 2, "backend": "ray", "max_num_seqs": 4})
    assert options == ReplicaOptions(replicas=2, backend="ray") and rest == {"max_num_seqs": 4}


def test_bad_replica_options_raise_before_an_engine_exists():
    from hearth_llm.engine import AsyncLLM

    with pytest.raises(ValueError, match="needs backend='ray'"):
        AsyncLLM("default", replicas=3)


@pytest.mark.parametrize("device, cluster_gpus, tp, bundle", [
    ("auto", 0, 1, {"CPU": 1}),             # no GPU in the cluster: one CPU per rank
    ("auto", 4, 2, {"CPU": 1, "GPU": 2}),   # the cluster's GPUs decide, not this machine's
    ("auto", 1, 2, {"CPU": 2}),             # too few GPUs for one replica's ranks: the CPU
    ("cpu", 4, 2, {"CPU": 2}),
    ("cuda", 0, 2, {"CPU": 1, "GPU": 2}),   # asked for: Ray waits for the GPUs (or says there is no room)
])
def test_each_replica_reserves_its_ranks_devices(device, cluster_gpus, tp, bundle):
    from hearth_llm.engine import EngineConfig
    from hearth_llm.engine.replicas.ray_cluster import replica_bundle

    config = EngineConfig(device=device, tensor_parallel_size=tp)
    assert replica_bundle(config, cluster_gpus).as_ray_bundle() == bundle
