"""Prefix sharing inside a step: a burst of requests over a prefix never seen before computes it
once (a later request hits the blocks an earlier one of the same step is computing), with tokens
equal to HF greedy and to an engine without the prefix cache; chunked prefill, preemption, an
abort and a failed step keep the prefix cache honest."""
import pytest

from hearth_llm.engine import SamplingParams
from hearth_llm.engine.kv_cache_manager import KVCacheManager
from hearth_llm.engine.request import Request

from conftest import hf_greedy, random_prompts

BLOCK_SIZE = 8
PREFIX_LEN = 40                       # five full blocks
SUFFIX_LENS = [3, 11, 1, 8, 5, 2]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 2 layers * 2 (k, v) * 8 tokens * 2 heads * 16 dims * 4 bytes per block of the tiny llama; a small
# pool, since building the default 1 GiB one (262,144 blocks) takes longer than the test
BLOCK_BYTES = 4096
# (float32 on a GPU too, where these tests check the Triton path: HF's reference runs in float32)
SMALL_POOL = dict(block_size=BLOCK_SIZE, kv_cache_memory=256 * BLOCK_BYTES, max_model_len=256, dtype="float32")


def burst_prompts(seed: int = 40) -> list[list[int]]:
    prefix = random_prompts(1, [PREFIX_LEN], seed=seed)[0]
    return [prefix + suffix for suffix in random_prompts(len(SUFFIX_LENS), SUFFIX_LENS, seed=seed + 1)]


def run_to_completion(engine, prompts, params=GREEDY, on_first_step=None) -> list:
    """Queue every prompt before the first step; the finished requests, in prompt order.
    ``on_first_step(requests)`` is called after the first step."""
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    engine.step()
    if on_first_step is not None:
        on_first_step([engine.groups[request_id][0] for request_id in ids])
    while engine.has_unfinished_requests():
        engine.step()
    requests = [engine.groups[request_id][0] for request_id in ids]
    for request_id in ids:
        engine.release(request_id)
    return requests


def tokens_of(requests) -> list[list[int]]:
    return [request.output_token_ids for request in requests]


@pytest.fixture(scope="module")
def expected(tiny_model_dirs):
    """HF greedy for the burst: the independent reference."""
    path = tiny_model_dirs["llama"]
    return [hf_greedy(path, prompt, MAX_TOKENS) for prompt in burst_prompts()]


def make_request(request_id, token_ids):
    return Request(request_id=request_id, prompt_token_ids=list(token_ids), sampling_params=SamplingParams(),
                   eos_token_ids=frozenset())


# ---- the manager's rule -----------------------------------------------------------------------------

def test_blocks_are_registered_when_allocated_and_hit_in_the_same_step():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", range(14))
    assert manager.allocate_slots(first, 14)          # nothing computed yet
    assert len(manager.find_cached_prefix(make_request("b", range(13)))) == 3


def test_blocks_registered_ahead_leave_the_cache_when_their_step_never_ran():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", range(12))
    assert manager.allocate_slots(first, 8)
    first.num_computed_tokens = 8                     # that step ran
    assert manager.allocate_slots(first, 4)           # registers the third block ahead of its step
    manager.free(first)                               # ... which failed before it ran
    assert len(manager.find_cached_prefix(make_request("b", range(13)))) == 2


def test_a_pending_token_or_a_proposal_never_completes_a_block_at_allocation():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    request = make_request("a", range(7))
    request.num_computed_tokens = 6
    manager.allocate_slots(request, 3)                # the last known token, then two proposals
    # the first block is full of known tokens; the second would end in a proposal
    assert len(manager.find_cached_prefix(make_request("b", range(9)))) == 1
    manager.free(request)


# ---- the engine --------------------------------------------------------------------------------------

def test_burst_over_a_new_prefix_computes_it_once_and_matches_hf(tiny_model_dirs, make_engine, expected):
    engine = make_engine(tiny_model_dirs["llama"], **SMALL_POOL)

    def all_prefilled(requests):
        assert [r.num_computed_tokens for r in requests] == [len(p) for p in burst_prompts()]
        assert engine.scheduler.num_computed_prompt_tokens == PREFIX_LEN + sum(SUFFIX_LENS)

    requests = run_to_completion(engine, burst_prompts(), on_first_step=all_prefilled)
    assert engine.scheduler.num_computed_prompt_tokens == PREFIX_LEN + sum(SUFFIX_LENS)
    assert [r.num_cached_tokens for r in requests] == [0] + [PREFIX_LEN] * (len(SUFFIX_LENS) - 1)
    assert engine.stats()["prefix_cache_hits"] == PREFIX_LEN * (len(SUFFIX_LENS) - 1)
    assert tokens_of(requests) == expected


def test_burst_matches_the_engine_without_prefix_cache(tiny_model_dirs, make_engine, expected):
    engine = make_engine(tiny_model_dirs["llama"], **SMALL_POOL, enable_prefix_caching=False)
    requests = run_to_completion(engine, burst_prompts())
    assert engine.scheduler.num_computed_prompt_tokens == sum(len(p) for p in burst_prompts())
    assert tokens_of(requests) == expected


def test_chunked_burst_computes_the_prefix_once(tiny_model_dirs, make_engine, expected):
    """The first prompt's chunks take the whole budget until its last one; the rest are admitted
    with what is left of that step, and hit every prefix block, none of it recomputed."""
    engine = make_engine(tiny_model_dirs["llama"], **SMALL_POOL, max_num_batched_tokens=16)
    requests = run_to_completion(engine, burst_prompts())
    assert engine.scheduler.num_computed_prompt_tokens == PREFIX_LEN + sum(SUFFIX_LENS)
    assert [r.num_cached_tokens for r in requests[1:]] == [PREFIX_LEN] * (len(SUFFIX_LENS) - 1)
    assert tokens_of(requests) == expected


def test_burst_under_preemption_matches_hf(tiny_model_dirs, make_engine, expected):
    # the burst needs 14 blocks with the prefix shared; 10 are there
    engine = make_engine(tiny_model_dirs["llama"], **{**SMALL_POOL, "kv_cache_memory": 10 * BLOCK_BYTES,
                                                       "max_model_len": 80})
    requests = run_to_completion(engine, burst_prompts())
    assert engine.stats()["num_preemptions"] > 0
    assert tokens_of(requests) == expected


def test_abort_of_the_first_request_mid_prefix_leaves_only_its_computed_blocks(tiny_model_dirs, make_engine,
                                                                                 expected):
    engine = make_engine(tiny_model_dirs["llama"], **SMALL_POOL, max_num_batched_tokens=16)
    first, *rest = burst_prompts()
    first_id = engine.add_request(first, GREEDY)
    engine.step()                                      # 16 of its tokens: two blocks computed
    assert engine.abort_request(first_id)
    engine.release(first_id)
    requests = run_to_completion(engine, rest)
    assert requests[0].num_cached_tokens == 16
    assert engine.scheduler.num_computed_prompt_tokens == 16 + PREFIX_LEN - 16 + sum(SUFFIX_LENS[1:])
    assert tokens_of(requests) == expected[1:]


def test_a_failed_step_serves_none_of_its_blocks_to_a_later_step(tiny_model_dirs, make_engine, expected, monkeypatch):
    """The step that would have computed the rest of the prefix fails before writing any KV: its
    blocks registered ahead must not be hit later (the cache would hand out zeros)."""
    engine = make_engine(tiny_model_dirs["llama"], **SMALL_POOL, max_num_batched_tokens=16)
    first, *rest = burst_prompts()
    first_id = engine.add_request(first, GREEDY)
    engine.step()                                      # two blocks computed
    run = engine.runner.run

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(engine.runner, "run", run)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.runner, "run", fail_once)
    [failure] = engine.step()                          # registered its next two blocks, then failed
    assert failure.request.request_id == first_id and failure.error is not None
    engine.release(first_id)
    requests = run_to_completion(engine, rest)
    assert requests[0].num_cached_tokens == 16
    assert tokens_of(requests) == expected[1:]


def test_samples_of_one_request_are_prefilled_in_one_step(tiny_model_dirs, make_engine):
    engine = make_engine(tiny_model_dirs["llama"], **SMALL_POOL)
    prompt = burst_prompts()[0]
    params = SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request_id = engine.add_request(prompt, params)
    engine.step()
    samples = engine.groups[request_id]
    assert [sample.num_computed_tokens for sample in samples] == [len(prompt)] * 3
    assert [sample.num_cached_tokens for sample in samples] == [0, PREFIX_LEN, PREFIX_LEN]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_computed_prompt_tokens == len(prompt) + 2 * (len(prompt) - PREFIX_LEN)
    expected = hf_greedy(tiny_model_dirs["llama"], prompt, MAX_TOKENS)
    assert [sample.output_token_ids for sample in samples] == [expected] * 3
    engine.release(request_id)


def test_a_prompt_hashed_at_once_chains_like_block_by_block():
    """The manager hashes a prompt's blocks from one buffer; each hash is the chained one."""
    from hearth_llm.engine.block_pool import hash_block_tokens, hash_blocks

    tokens = list(range(100, 133))
    chained, parent = [], None
    for start in range(0, 32, 8):
        parent = hash_block_tokens(parent, tokens[start:start + 8], "tenant")
        chained.append(parent)
    assert hash_blocks(None, tokens, 8, "tenant") == chained
    assert hash_blocks(chained[1], tokens[16:], 8, "tenant") == chained[2:]
    assert hash_blocks(None, tokens, 8) != chained


def test_a_prompt_sharing_a_recent_prompts_blocks_gets_the_hashes_it_would_compute():
    """Hashes copied from a recent prompt with the same first block equal hashing from scratch (a
    manager that saw nothing else), wherever the two prompts part: mid-block, at a block edge, not at
    all, shorter, longer, or in the first block; and only under the same salt."""
    def hashed(manager, request_id, tokens, salt):
        request = make_request(request_id, tokens)
        request.cache_salt = salt
        manager.find_cached_prefix(request)
        return request.block_hashes

    base = list(range(100, 140))                               # five blocks of 8
    others = [base[:21] + [7] * 19, base[:24] + [7] * 9, base[:], base[:30], base + [9] * 20, [5] + base[1:]]
    for salt in (None, "tenant"):
        manager = KVCacheManager(num_blocks=16, block_size=8)
        hashed(manager, "a", base, salt)
        for index, tokens in enumerate(others):
            alone = hashed(KVCacheManager(num_blocks=16, block_size=8), "alone", tokens, salt)
            assert hashed(manager, f"b{index}", tokens, salt) == alone, (salt, index)
    manager = KVCacheManager(num_blocks=16, block_size=8)
    assert hashed(manager, "a", base, None)[0] != hashed(manager, "b", base, "tenant")[0]


def test_a_freed_request_leaves_no_prompt_behind_for_hash_copies():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    request = make_request("a", range(12))
    manager.find_cached_prefix(request)
    assert manager.allocate_slots(request, 12)
    assert len(manager._recent_prompts) == 1
    manager.free(request)
    assert not manager._recent_prompts
