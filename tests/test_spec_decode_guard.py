"""The adaptive proposer's guards (speculative.adaptive_proposal_length on the CPU): a proposal must
promise a margin over a decode step, and a request whose proposals keep missing while its
speculation is in the red pauses them, then re-probes with one token. Synthetic costs and
acceptance, no model."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from hearth_llm.engine.spec_decode import NgramProposer
from hearth_llm.engine.spec_decode import proposal_lengths as pl
from hearth_llm.engine.spec_decode.proposal_lengths import AcceptanceEstimate, best_length


@dataclass
class FakeRequest:
    request_id: str
    token_ids: list[int]
    is_finished: bool = False


def float32_costs(num_rows: int) -> float:   # measured: bench spec --dtype float32, AVX2 kernels
    return (1.0, 1.34, 1.99, 2.61, 3.32)[num_rows - 1]


def test_a_proposal_must_promise_the_margin_over_a_decode_step():
    # one token at p: (1 + p) / 1.34 tokens per cost; the break-even is p = 0.34
    assert best_length([0.40], float32_costs) == 1
    assert best_length([0.40], float32_costs, min_gain=pl.MIN_GAIN) == 0
    assert best_length([0.50], float32_costs, min_gain=pl.MIN_GAIN) == 1   # 1.12x
    assert best_length([0.99, 0.99, 0.99, 0.99], float32_costs, min_gain=pl.MIN_GAIN) == 3
    assert pl.MIN_GAIN > 0


def test_outright_misses_in_the_red_pause_proposals_for_longer_each_time():
    estimate = AcceptanceEstimate()
    kinds = estimate.kinds(2, False, 1)
    estimate.record(kinds, num_accepted=0, extra_cost=0.34)
    assert estimate.net == pytest.approx(-0.34)
    assert estimate.idle == pl.FIRST_PAUSE and estimate.is_probing       # in the red: paused
    estimate.idle = 0
    estimate.record(kinds, num_accepted=0, extra_cost=0.34)              # the re-probe missed
    assert estimate.idle == 2 * pl.FIRST_PAUSE
    for _ in range(10):
        estimate.idle = 0
        estimate.record(kinds, num_accepted=0, extra_cost=0.34)
    assert estimate.idle == pl.MAX_PAUSE
    estimate.record(kinds, num_accepted=1, extra_cost=0.34)              # a hit ends the probing
    assert not estimate.is_probing and estimate.misses == 0
    assert estimate.pause == pl.MAX_PAUSE                                # still in the red


def test_misses_while_speculation_is_in_the_black_do_not_pause():
    estimate = AcceptanceEstimate()
    estimate.record(estimate.kinds(4, False, 3), num_accepted=3, extra_cost=1.6)   # earned 1.4 steps
    misses = 0
    while estimate.net - 0.34 >= 0:
        estimate.record(estimate.kinds(2, False, 1), num_accepted=0, extra_cost=0.34)
        misses += 1
        assert estimate.idle == 0 and not estimate.is_probing
    assert misses == 4 and estimate.misses == 4
    estimate.record(estimate.kinds(2, False, 1), num_accepted=0, extra_cost=0.34)  # now in the red
    assert estimate.net < 0 and estimate.idle == pl.FIRST_PAUSE and estimate.is_probing


def periodic_request() -> FakeRequest:
    return FakeRequest("a", [1, 2, 3, 4, 5, 6, 7, 8] * 3)


def run_accepting(proposer: NgramProposer, request: FakeRequest, num_steps: int) -> list[int]:
    """Proposal lengths over ``num_steps`` steps whose proposals the target all accepts."""
    lengths = []
    for _ in range(num_steps):
        proposal = proposer.propose([request], [4])[0]
        lengths.append(len(proposal))
        request.token_ids += [request.token_ids[-8 + i % 8] for i in range(len(proposal) + 1)]
    return lengths


def test_a_paused_request_proposes_nothing_then_reprobes_with_one_token():
    unguarded = NgramProposer(min_n=2, max_n=4, step_cost=pl.cpu_step_cost)
    assert run_accepting(unguarded, periodic_request(), 1) == [3]   # a clean 4-token match: 3 rows pay
    proposer = NgramProposer(min_n=2, max_n=4, step_cost=pl.cpu_step_cost)
    request = periodic_request()
    assert proposer.propose([request], [0]) == [[]]
    estimate = proposer._sent["a"].estimate
    estimate.record(estimate.kinds(4, False, 1), num_accepted=0, extra_cost=0.34)   # rejected, in the red
    assert estimate.idle == pl.FIRST_PAUSE
    # paused, then a one-token probe (accepted: its balance is back above zero), then full proposals
    lengths = run_accepting(proposer, request, 5)
    assert lengths[:pl.FIRST_PAUSE] == [0] * pl.FIRST_PAUSE
    assert lengths[pl.FIRST_PAUSE:] == [1, 3, 3]
    assert estimate.net > 0 and estimate.pause == pl.FIRST_PAUSE and not estimate.is_probing
