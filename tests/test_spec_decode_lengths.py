"""Proposal lengths sized by the device's verify-step costs (speculative.adaptive_proposal_length),
and verify rows whose logits round as a decode step's do."""
from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from numpy.lib.stride_tricks import sliding_window_view

from hearth_llm.engine import EngineConfig, SamplingParams
from hearth_llm.engine.spec_decode import NgramProposer, SpeculativeConfig, step_costs_for
from hearth_llm.engine.spec_decode.proposal_lengths import (FIRST_TOKEN_PRIOR, AcceptanceEstimate, MeasuredStepCosts,
                                                            best_length, cpu_step_cost)

from conftest import hf_greedy, random_prompts


@dataclass
class FakeRequest:
    request_id: str
    token_ids: list[int]
    is_finished: bool = False


def flat_cost(num_rows: int) -> float:
    return 1.0


# ---- best_length -------------------------------------------------------------------------------

def test_free_rows_propose_everything_that_might_be_accepted():
    assert best_length([0.9, 0.5, 0.1, 0.01], flat_cost) == 4
    assert best_length([], flat_cost) == 0


def test_a_fifth_cpu_row_is_not_worth_its_second_pass_over_the_weights():
    # a 5-row step (a second pass of the int4 kernel's 4-row blocks) costs far more than a 4-row one:
    # even a certain 4th proposal yields 5 tokens for 1.80 against 4 for 1.41
    assert cpu_step_cost(5) - cpu_step_cost(4) > 2 * (cpu_step_cost(4) - cpu_step_cost(3))
    assert best_length([0.9, 0.9, 0.9, 0.9], cpu_step_cost) == 3
    assert best_length([1.0, 1.0, 1.0, 1.0], cpu_step_cost) == 3
    assert best_length([1.0] * 7, cpu_step_cost) == 7   # 8 rows: two full blocks of 4


def test_an_unlikely_first_token_is_not_worth_a_verify_row():
    assert best_length([0.05, 1.0, 1.0], cpu_step_cost) == 0
    # the break-even: (1 + p) / cost(2) > 1 / cost(1)
    break_even = cpu_step_cost(2) - 1
    assert best_length([break_even + 0.02], cpu_step_cost) == 1
    assert best_length([break_even - 0.02], cpu_step_cost) == 0


def test_cpu_costs_grow_with_rows_past_the_table_and_gpus_have_none():
    costs = [cpu_step_cost(rows) for rows in range(1, 20)]
    assert costs[0] == 1.0 and all(b > a for a, b in zip(costs, costs[1:]))
    assert isinstance(step_costs_for("cpu"), MeasuredStepCosts)
    assert step_costs_for("cpu") is not step_costs_for("cpu")   # each engine measures its own
    assert step_costs_for("cuda") is None


# ---- measured step costs ----------------------------------------------------------------------------

def decode_steps(costs: MeasuredStepCosts, seconds: float) -> None:
    for _ in range(MeasuredStepCosts.NUM_RECENT_DECODES):
        costs.observe(1, seconds)


def test_measured_costs_start_at_the_table_and_take_this_machines_step_times():
    costs = MeasuredStepCosts()
    assert [costs(rows) for rows in (1, 3, 5)] == [cpu_step_cost(1), cpu_step_cost(3), cpu_step_cost(5)]
    decode_steps(costs, 0.050)
    for _ in range(MeasuredStepCosts.MIN_SAMPLES):
        costs.observe(2, 0.082)   # a float32 machine: a second row costs 64 % more
        costs.observe(5, 0.104)
    assert costs(1) == 1.0
    assert costs(2) == pytest.approx(1.64) and costs(5) == pytest.approx(2.08)
    assert costs.measured() == {1: 1.0, 2: pytest.approx(1.64), 5: pytest.approx(2.08)}
    # rows not measured yet cost what the nearest smaller measured count does: tried, then measured
    assert costs(3) == costs(4) == pytest.approx(1.64)
    assert best_length([0.6], costs) == 0                  # (1 + 0.6) / 1.64 < 1
    assert best_length([0.9, 0.9, 0.9, 0.9], costs) == 3   # 3.4 tokens for 4 rows at 1.64 (not measured)
    for _ in range(MeasuredStepCosts.MIN_SAMPLES):
        costs.observe(4, 0.112)
    assert best_length([0.9, 0.9, 0.9, 0.9], costs) == 4   # 4 rows measured at 2.24: 4.1 tokens for 2.08


def test_a_verify_step_is_compared_with_the_decode_steps_just_before_it():
    costs = MeasuredStepCosts()
    decode_steps(costs, 0.010)
    for _ in range(MeasuredStepCosts.MIN_SAMPLES):
        costs.observe(3, 0.012)
    decode_steps(costs, 0.030)    # the machine got busy: every step takes three times as long
    for _ in range(MeasuredStepCosts.MIN_SAMPLES + 1):
        costs.observe(3, 0.036)
    assert costs(3) == pytest.approx(1.2)
    costs.observe(3, 0.300)       # one step that lost the core to other work: the median holds
    assert costs(3) == pytest.approx(1.2)


def test_measured_costs_wait_for_enough_steps():
    costs = MeasuredStepCosts()
    costs.observe(4, 0.040)       # no decode steps to compare with yet: not counted
    for _ in range(MeasuredStepCosts.NUM_RECENT_DECODES - 1):
        costs.observe(1, 0.010)
    assert costs(4) == cpu_step_cost(4)
    costs.observe(1, 0.010)
    for _ in range(MeasuredStepCosts.MIN_SAMPLES - 1):
        costs.observe(4, 0.040)
    assert costs(4) == cpu_step_cost(4)   # nothing trusted above decode yet: the table
    costs.observe(4, 0.040)
    assert costs(4) == pytest.approx(4.0)


def test_rows_not_measured_are_never_free():
    # A fresh engine has measured decode steps but no verify step yet: its first proposals were once
    # sized as if verify rows cost nothing (whole 4-token matches at 3.3 decode steps on float32).
    costs = MeasuredStepCosts()
    decode_steps(costs, 0.010)
    assert [costs(rows) for rows in range(2, 6)] == [cpu_step_cost(rows) for rows in range(2, 6)]
    assert best_length([0.85, 0.9, 0.9, 0.9], costs) == 3   # the table's 5th row is a second pass
    for _ in range(MeasuredStepCosts.MIN_SAMPLES):
        costs.observe(2, 0.0134)                             # float32 AVX2: a second row costs 1.34
    assert costs(2) == costs(5) == pytest.approx(1.34)       # then larger counts are tried


# ---- the acceptance estimate ----------------------------------------------------------------------

def test_the_estimate_starts_at_the_prior_and_moves_to_what_the_request_showed():
    estimate = AcceptanceEstimate()
    prior = FIRST_TOKEN_PRIOR[(2, False)]
    assert estimate.probabilities(2, False, 1) == [prior]
    kinds = estimate.kinds(2, False, 3)
    for _ in range(8):
        estimate.record(kinds, num_accepted=0)   # first token rejected: the later ones were not tested
    assert estimate.probabilities(2, False, 1) == [pytest.approx(prior * 4 / (4 + 8))]   # prior weighs 4
    assert estimate.probabilities(2, False, 3)[1:] == AcceptanceEstimate().probabilities(2, False, 3)[1:]
    assert estimate.probabilities(3, False, 1) == AcceptanceEstimate().probabilities(3, False, 1)  # other kind


def test_matches_longer_than_four_share_the_four_token_kind():
    assert AcceptanceEstimate.kinds(7, False, 2) == AcceptanceEstimate.kinds(4, False, 2)


# ---- the proposer ---------------------------------------------------------------------------------

def test_a_match_whose_occurrences_disagree_is_flagged_ambiguous():
    proposer = NgramProposer(min_n=1, max_n=3)
    match = proposer.find_match([9, 4, 9, 5, 9])
    assert (match.length, match.start, match.is_ambiguous) == (1, 3, True)   # 9 -> 4, then 9 -> 5
    match = proposer.find_match([9, 4, 7, 1, 9, 4, 2, 9])     # 9 -> 4 both times
    assert (match.length, match.is_ambiguous) == (1, False)


def windowed_match(token_ids: list[int], min_n: int, max_n: int):
    """The reference: for n = max_n .. min_n, every window of n tokens before the suffix compared
    with it; (length, start of what followed the latest, whether other occurrences disagree)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        matches = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[-n:]).all(axis=1))
        if matches.size:
            following = tokens[matches + n]
            return n, int(matches[-1]) + n, bool((following != following[-1]).any())
    return None


def test_the_match_is_the_windowed_searchs_on_random_sequences():
    generator = random.Random(7)
    for _ in range(3000):
        tokens = [generator.randrange(generator.choice([2, 3, 5, 40])) for _ in range(generator.randint(1, 48))]
        low = generator.randint(1, 4)
        high = generator.randint(low, 7)
        match = NgramProposer(min_n=low, max_n=high).find_match(tokens)
        expected = windowed_match(tokens, low, high)
        assert (None if match is None else (match.length, match.start, match.is_ambiguous)) == expected, tokens
        if match is not None:   # the tokens before the continuation are the suffix's last match.length
            assert tokens[match.start - match.length:match.start] == tokens[-match.length:]
    assert NgramProposer(min_n=1, max_n=2).find_match((3, 4, 3)).start == 1   # any sequence type


def test_with_step_costs_a_weak_match_proposes_nothing_and_a_long_one_its_cheap_rows():
    proposer = NgramProposer(min_n=2, max_n=4, step_cost=cpu_step_cost)
    weak = FakeRequest("weak", [7, 9, 4, 7, 9, 5, 7, 9])     # [7, 9] was followed by 4, then by 5
    assert NgramProposer(min_n=2, max_n=4).propose([weak], [4]) == [[5, 7, 9]]  # the whole match
    long = FakeRequest("long", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4])
    assert proposer.propose([weak, long], [4, 4]) == [[], [5, 6, 7]]   # 3 of 4: a 5th row costs a pass


def test_without_step_costs_the_whole_match_is_proposed_as_before():
    proposer = NgramProposer(min_n=1, max_n=4)
    long = FakeRequest("long", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4])
    assert proposer.propose([long], [4]) == [[5, 6, 7, 8]]


def test_a_proposals_fate_is_learned_and_a_request_that_keeps_missing_stops_proposing():
    proposer = NgramProposer(min_n=2, max_n=2, step_cost=cpu_step_cost)
    request = FakeRequest("a", [7, 8, 1, 5, 6, 7, 8])
    assert proposer.propose([request], [3]) == [[1, 5, 6]]
    request.token_ids += [1, 5, 3]      # two accepted, the third rejected (the target drew 3)
    proposer.propose([request], [3])
    estimate = proposer._sent["a"].estimate
    assert estimate.counts == {("first", 2, False): [1, 1], ("later", 2): [1, 2]}
    other = FakeRequest("b", [4, 2, 9, 4, 2])   # a fresh request still trusts a 2-token match
    assert proposer.propose([other], [1]) == [[9]]
    for _ in range(40):                 # its 2-token matches kept missing: below the break-even
        estimate.record(estimate.kinds(2, False, 1), num_accepted=0)
    request.token_ids += [5, 6]         # [5, 6] was followed by 7: the same kind of match
    assert NgramProposer(min_n=2, max_n=2, step_cost=cpu_step_cost).propose([request], [3]) == [[7, 8, 1]]
    assert proposer.propose([request], [3]) == [[]]


def test_finished_requests_are_forgotten_with_their_estimates():
    proposer = NgramProposer(min_n=1, max_n=2, step_cost=cpu_step_cost)
    request = FakeRequest("a", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    assert proposer.propose([request], [2]) == [[3, 4]]
    request.is_finished = True
    proposer.forget_finished()
    assert proposer._sent == {}


# ---- config and engine wiring ----------------------------------------------------------------------

def test_adaptive_lengths_are_an_ngram_option_on_by_default_and_checked():
    assert SpeculativeConfig.coerce({"method": "ngram"}).adaptive_proposal_length is True
    assert SpeculativeConfig.coerce({"method": "ngram", "adaptive_proposal_length": False}) \
        .adaptive_proposal_length is False
    with pytest.raises(ValueError, match="adaptive_proposal_length"):
        SpeculativeConfig.coerce({"method": "ngram", "adaptive_proposal_length": "yes"})
    with pytest.raises(ValueError, match="adaptive_proposal_length"):
        SpeculativeConfig.coerce({"method": "draft_model", "model": "x", "adaptive_proposal_length": True})
    assert EngineConfig(speculative={"method": "ngram", "adaptive_proposal_length": False}) \
        .speculative.adaptive_proposal_length is False


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_cpu_engine_sizes_proposals_by_cpu_costs_and_stays_equal_to_hf(adaptive, tiny_model_dirs, make_engine):
    target = tiny_model_dirs["llama"]
    engine = make_engine(target, dtype="float32", kv_cache_memory="4MiB", speculative={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive_proposal_length": adaptive})
    assert isinstance(engine.proposer.step_cost, MeasuredStepCosts) if adaptive else engine.proposer.step_cost is None
    prompts = random_prompts(2, [13, 9], seed=61)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    tokens = {request_id: [] for request_id in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request.request_id] += delta.new_token_ids
    for request_id, prompt in zip(ids, prompts):
        assert tokens[request_id] == hf_greedy(target, prompt, 20)


def test_a_cpu_engine_measures_its_one_request_decode_and_verify_steps(tiny_model_dirs, make_engine):
    target = tiny_model_dirs["llama"]
    engine = make_engine(target, dtype="float32", kv_cache_memory="4MiB", speculative={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    observed = []

    class Recorded(MeasuredStepCosts):
        def observe(self, num_rows, seconds):
            observed.append((num_rows, seconds))
            super().observe(num_rows, seconds)

    engine.proposer.step_cost = Recorded()
    engine.add_request([5, 6, 7, 8] * 6, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(observed) == engine.num_steps - 1   # every step but the prefill
    assert all(1 <= rows <= 4 and seconds > 0 for rows, seconds in observed)
    assert engine.stats()["spec_decode_num_drafts"] == sum(rows > 1 for rows, _ in observed)


# ---- verify rows round as decode rows --------------------------------------------------------------

@pytest.mark.parametrize("quant_type", ["Q8_0", "Q6_K"])
def test_the_block_head_gives_each_row_of_a_verify_step_the_logits_it_gives_it_alone(quant_type):
    from hearth_llm.engine.loader.gguf_blocks import GGUFBlocks
    from hearth_llm.engine.models.cpu_weights import CpuBlockLogitsHead
    from hearth_llm.kernels.quant import gguf_cpu_native

    if not gguf_cpu_native.available():
        pytest.skip("the GGUF C kernels are not built here")
    from test_quant_gguf import random_blocks

    blocks = GGUFBlocks(quant_type, random_blocks(quant_type, 96, 256, seed=15))
    head = CpuBlockLogitsHead(SimpleNamespace(in_features=256, out_features=96), blocks)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    alone = torch.cat([head(x[i:i + 1]) for i in range(8)])
    for rows in (2, 3, 5, 8):   # a verify step of k = rows - 1 proposals, or a batch
        assert torch.equal(head(x[:rows]), alone[:rows]), rows
