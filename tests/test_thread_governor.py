"""The CPU thread governor: each step size runs on the thread count measured fastest for it."""
from __future__ import annotations

import pytest
import torch

from hearth_llm.engine import EngineConfig, SamplingParams
from hearth_llm.engine.thread_governor import ThreadGovernor


def run_steps(governor: ThreadGovernor, num_tokens: int, seconds_by_count: dict[int, float], num_steps: int):
    """Drive ``num_steps`` steps whose time depends only on the chosen count; the counts chosen."""
    chosen = []
    for _ in range(num_steps):
        count = governor.choose(num_tokens)
        governor.record(num_tokens, count, seconds_by_count[count])
        chosen.append(count)
    return chosen


def test_candidates_are_one_thread_half_and_all():
    assert ThreadGovernor(2).candidates == [1, 2]
    assert ThreadGovernor(8).candidates == [1, 4, 8]
    assert ThreadGovernor(1).candidates == [1]


def test_each_count_is_timed_once_then_the_fastest_runs():
    governor = ThreadGovernor(2)
    chosen = run_steps(governor, num_tokens=1, seconds_by_count={1: 0.010, 2: 0.015}, num_steps=20)
    assert chosen[:2] == [2, 1]                  # all threads first, as without a governor
    assert chosen[2:] == [1] * 18


def test_the_slower_count_is_retimed_and_taken_back_when_it_became_faster():
    governor = ThreadGovernor(2)
    run_steps(governor, 1, {1: 0.010, 2: 0.015}, num_steps=10)
    # the contention is gone: 2 threads are now faster, which only a re-timing can show
    chosen = run_steps(governor, 1, {1: 0.010, 2: 0.005}, num_steps=4 * ThreadGovernor.RETIME_EVERY)
    assert 2 in chosen[:ThreadGovernor.RETIME_EVERY]
    assert chosen[-ThreadGovernor.RETIME_EVERY:].count(2) >= ThreadGovernor.RETIME_EVERY - 1


def test_step_sizes_are_governed_apart():
    governor = ThreadGovernor(2)
    run_steps(governor, 1, {1: 0.010, 2: 0.015}, num_steps=6)         # decode: 1 thread wins
    run_steps(governor, 500, {1: 0.800, 2: 0.450}, num_steps=6)       # prefill: 2 threads win
    assert governor.choose(1) == 1 and governor.choose(400) == 2     # 256-511 tokens: one size
    assert governor.summary()[1] == {1: 0.010, 2: 0.015}


def test_one_slow_step_does_not_decide():
    governor = ThreadGovernor(2)
    run_steps(governor, 1, {1: 0.010, 2: 0.008}, num_steps=5)
    governor.record(1, 2, 1.0)                                         # a page fault, a preemption
    assert governor.choose(1) == 2


def test_the_body_runs_on_the_chosen_count_and_torchs_count_is_restored():
    governor = ThreadGovernor(2)
    torch.set_num_threads(2)
    seen = []
    for _ in range(2):
        with governor.threads_for(num_tokens=1) as count:
            seen.append((count, torch.get_num_threads()))
    assert seen == [(2, 2), (1, 1)]
    assert torch.get_num_threads() == 2


def test_a_failing_step_restores_the_count_and_is_not_timed():
    governor = ThreadGovernor(2)
    torch.set_num_threads(2)
    with pytest.raises(RuntimeError), governor.threads_for(num_tokens=1):
        raise RuntimeError("forward failed")
    assert torch.get_num_threads() == 2 and governor.summary() == {}


def test_adaptive_threads_is_validated_and_can_be_turned_off():
    with pytest.raises(ValueError, match="adaptive_threads"):
        EngineConfig(adaptive_threads="yes")
    assert EngineConfig(adaptive_threads=False).adaptive_threads is False


def test_a_cpu_engine_governs_its_threads_and_serves_the_same_tokens(tiny_model_dirs, make_engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for adaptive in (True, False):
        engine = make_engine(tiny_model_dirs["llama"], device="cpu", dtype="float32", num_threads=2,
                             adaptive_threads=adaptive)
        engine.add_request([5, 6, 7, 8, 9], params)
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for delta in engine.step() for t in delta.new_token_ids]
        outputs[adaptive] = tokens
        assert (engine.thread_governor is not None) == adaptive
        if adaptive:
            assert set(engine.thread_governor.summary()) == {1, 3}    # decode steps and the 5-token prefill
    assert outputs[True] == outputs[False] and len(outputs[True]) == 12
    torch.set_num_threads(2)
