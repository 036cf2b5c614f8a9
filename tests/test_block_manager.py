"""Block pool and KV cache manager: hash chains, LRU eviction, reference counts, aborts."""
import pytest

from hearth_llm.engine import SamplingParams
from hearth_llm.engine.block_pool import BlockPool, hash_block_tokens
from hearth_llm.engine.kv_cache_manager import KVCacheManager
from hearth_llm.engine.request import Request

from conftest import random_prompts


def make_request(request_id, token_ids, salt=None):
    return Request(request_id=request_id, prompt_token_ids=list(token_ids), sampling_params=SamplingParams(),
                   eos_token_ids=frozenset(), cache_salt=salt)


def test_hash_chains_through_the_parent():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], extra_key="tenant-a") != first


def test_free_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(1), pool.allocate(1), pool.allocate(1)
    for block, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(block[0], key)
    pool.free(b)
    pool.free(a)
    pool.free(c)
    # block 3 was never used; then the freeing order b, a, c is the eviction order.
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) == b and pool.lookup(b"b") is None
    assert pool.lookup(b"a") == a[0] and pool.lookup(b"c") == c[0]


def test_reference_counts_keep_shared_blocks_out_of_the_free_queue():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"x")
    pool.touch([block])
    assert pool.blocks[block].ref_count == 2
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2
    assert pool.lookup(b"x") == block  # still cached while free, until reused


def test_prefix_lookup_stops_at_the_first_miss_and_keeps_the_last_token():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", range(12))
    assert manager.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    manager.cache_computed_blocks(first)
    same = make_request("b", range(12))
    assert len(manager.find_cached_prefix(same)) == 2  # the third block holds the token to recompute
    diverging = make_request("c", [0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12])
    assert len(manager.find_cached_prefix(diverging)) == 1
    other_tenant = make_request("d", range(12), salt="tenant-b")
    assert manager.find_cached_prefix(other_tenant) == []
    manager.free(first)
    assert manager.num_free_blocks == 16


def test_allocation_fails_without_side_effects_when_the_pool_is_short():
    manager = KVCacheManager(num_blocks=3, block_size=4)
    request = make_request("a", range(20))
    assert not manager.allocate_slots(request, 20)
    assert request.block_ids == [] and manager.num_free_blocks == 3


def test_abort_mid_prefill_frees_blocks(tiny_model_dirs, make_engine):
    engine = make_engine(tiny_model_dirs["llama"], max_num_batched_tokens=8, block_size=4)
    request_id = engine.add_request(random_prompts(1, [40])[0], SamplingParams(max_tokens=4))
    engine.step()
    request = engine.groups[request_id][0]
    assert request.is_prefilling and request.block_ids
    assert engine.abort_request(request_id)
    assert request.finish_reason == "abort"
    engine.release(request_id)
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


# async scheduling on the CPU too: the aborted request has a step in flight when it is aborted
@pytest.mark.parametrize("async_scheduling", [None, True], ids=["default", "async"])
def test_abort_mid_decode_frees_blocks_and_others_continue(tiny_model_dirs, make_engine, async_scheduling):
    engine = make_engine(tiny_model_dirs["llama"], device="cpu", async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    keep, drop = (engine.add_request(p, params) for p in random_prompts(2, [6, 9]))
    for _ in range(3):
        engine.step()
    assert engine.abort_request(drop)
    assert not engine.abort_request(drop)  # already finished
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.groups[keep][0].output_token_ids) == 10
    assert engine.groups[drop][0].finish_reason == "abort"
    engine.release(keep)
    engine.release(drop)
