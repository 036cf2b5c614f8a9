"""The n-gram proposer's backoff, its config, and the KV blocks a rolled-back step gives back."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from hearth_llm.engine import EngineConfig, SamplingParams
from hearth_llm.engine.block_pool import BlockPool
from hearth_llm.engine.spec_decode import NgramProposer, SpeculativeConfig

from conftest import hf_greedy, random_prompts
from test_spec_decode_graphs import CopyLastTokenProposer, _self_draft


@dataclass
class FakeRequest:
    request_id: str
    token_ids: list[int]
    is_finished: bool = False


# ---- backoff ----------------------------------------------------------------------------------

def test_a_missed_proposal_needs_a_longer_match_next_and_a_hit_lifts_that():
    proposer = NgramProposer(min_n=1, max_n=3, backoff=True)
    # "9" occurred once, followed by 4: a 1-token match proposes [4, ...]
    request = FakeRequest("a", [9, 4, 5, 6, 7, 9])
    assert proposer.propose([request], [2]) == [[4, 5]]
    request.token_ids += [8]  # the target drew 8: the proposal missed outright
    # "8" alone matches nothing longer; [7, 9, 8] has no 2-token match: backed off, nothing proposed
    request.token_ids += [6]  # (a plain decode step happened: the state is kept)
    assert proposer.propose([request], [2]) == [[]]
    assert proposer.propose_one(request.token_ids, 2) == [7, 9]  # what a 1-token match would propose
    request.token_ids += [7]  # [6, 7] occurs: a 2-token match, allowed while backed off
    assert proposer.propose([request], [2]) == [[9, 8]]
    request.token_ids += [9]  # its first token accepted: back to 1-token matches
    assert not proposer._is_backed_off(request, proposer._sent["a"])
    assert proposer.propose([request], [3]) == [[8, 6, 7]]


def test_without_backoff_every_step_tries_the_shortest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    request = FakeRequest("a", [9, 4, 5, 6, 7, 9])
    assert proposer.propose([request], [2]) == [[4, 5]]
    request.token_ids += [8, 6]
    assert proposer.propose([request], [2]) == [[7, 9]]


def test_finished_requests_are_forgotten_and_a_reused_id_starts_fresh():
    proposer = NgramProposer(min_n=1, max_n=2, backoff=True)
    first = FakeRequest("a", [3, 1, 2, 3])
    assert proposer.propose([first], [1]) == [[1]]
    first.token_ids += [5]  # missed
    first.is_finished = True
    proposer.forget_finished()
    assert proposer._sent == {}
    second = FakeRequest("a", [3, 1, 2, 3, 5, 5])  # same id, new request: not backed off
    assert proposer.propose([second], [1]) == [[5]]


# ---- config ------------------------------------------------------------------------------------

def test_backoff_is_an_ngram_option_off_by_default_and_checked():
    spec = SpeculativeConfig.coerce({"method": "ngram"})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.prompt_lookup_backoff) == (2, 5, False)
    assert EngineConfig(speculative={"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_backoff": True}) \
        .speculative.prompt_lookup_backoff is True
    with pytest.raises(ValueError, match="prompt_lookup_backoff"):
        SpeculativeConfig.coerce({"method": "ngram", "prompt_lookup_backoff": 1})
    with pytest.raises(ValueError, match="backoff"):
        SpeculativeConfig.coerce({"method": "draft_model", "model": "x", "prompt_lookup_backoff": True})


# ---- blocks given back by a rollback -------------------------------------------------------------

def test_uncached_blocks_freed_with_reuse_first_come_back_first_and_cached_ones_stay_last():
    pool = BlockPool(6)
    blocks = pool.allocate(4)                      # [0, 1, 2, 3]; 4, 5 free
    pool.cache_block(blocks[3], b"h3")
    pool.free([blocks[2], blocks[1]], reuse_first=True)   # tail first, as the KV manager passes them
    pool.free([blocks[3]], reuse_first=True)       # cached: stays at the back, evicted last
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) == [4, 5, 3]


def test_a_lone_speculating_sequence_keeps_one_run_of_blocks_and_matches_hf(tiny_model_dirs, make_engine):
    target = tiny_model_dirs["llama"]
    prompt = random_prompts(1, [11], seed=44)[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for backoff in (True, False):
        engine = make_engine(target, dtype="float32", block_size=4, kv_cache_memory="4MiB", speculative={
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "prompt_lookup_backoff": backoff})
        engine.add_request(prompt, params)
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for delta in engine.step() for t in delta.new_token_ids]
            for request in engine.scheduler.running:
                ids = request.block_ids
                assert ids == list(range(ids[0], ids[0] + len(ids))), ids
        stats = engine.stats()
        assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"], stats
        assert tokens == hf_greedy(target, prompt, 24)


# ---- abort mid-run; requests that never speculate ------------------------------------------------

@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_aborting_a_speculating_request_frees_its_blocks_and_spares_the_others(method, tiny_model_dirs,
                                                                               make_engine):
    target = tiny_model_dirs["llama"]
    speculative = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
                   if method == "ngram" else _self_draft(target))
    engine = make_engine(target, dtype="float32", block_size=4, kv_cache_memory="4MiB", speculative=speculative)
    if method == "ngram":
        engine.proposer = CopyLastTokenProposer()
    prompts = random_prompts(2, [9, 14], seed=46)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kept, doomed = (engine.add_request(prompt, params) for prompt in prompts)
    tokens = {kept: [], doomed: []}
    for _ in range(3):
        for delta in engine.step():
            tokens[delta.request.request_id] += delta.new_token_ids
    assert engine.abort_request(doomed) and engine.stats()["spec_decode_num_drafts"] > 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request.request_id] += delta.new_token_ids
    assert tokens[kept] == hf_greedy(target, prompts[0], 20)
    assert 0 < len(tokens[doomed]) < 20
    if method == "self_draft":  # the draft's shadow of the aborted request is gone too
        assert doomed not in engine.proposer.shadows and engine.proposer.kv_cache.num_free_blocks == \
            engine.proposer.kv_cache.num_total_blocks - sum(len(s.block_ids) for _, s, _ in
                                                            engine.proposer.shadows.values())
    # (make_engine checks that the target's pool is whole once the test ends)


def test_penalties_and_min_tokens_run_without_proposals_and_match_the_plain_engine(tiny_model_dirs, make_llm):
    target = tiny_model_dirs["llama"]
    prompts = random_prompts(2, [12, 6], seed=47)
    params = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=12)]
    plain = make_llm(target, dtype="float32", kv_cache_memory="4MiB")
    speculating = make_llm(target, dtype="float32", kv_cache_memory="4MiB",
                           speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    speculating.engine.proposer = CopyLastTokenProposer()
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = speculating.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert speculating.stats()["spec_decode_num_drafts"] == 0
    # the same prompts without those settings do get proposals
    speculating.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert speculating.stats()["spec_decode_num_drafts"] > 0


def test_grammar_requests_are_not_speculated():
    from hearth_llm.engine.llm_engine import LLMEngine
    from hearth_llm.engine.request import Request

    def decoding(params, **state):
        request = Request("r", [5, 6, 7], params, frozenset())
        request.num_computed_tokens = request.num_tokens - 1
        for name, value in state.items():
            setattr(request, name, value)
        return request

    greedy = SamplingParams(temperature=0, max_tokens=8)
    assert LLMEngine._may_speculate(decoding(greedy))
    assert not LLMEngine._may_speculate(decoding(greedy, grammar_future=object()))  # compiling
    assert not LLMEngine._may_speculate(decoding(greedy, matcher=object()))         # compiled
    assert not LLMEngine._may_speculate(decoding(SamplingParams(temperature=0, max_tokens=8, speculative=False)))
