"""Async scheduling (step N+1 scheduled while step N runs, tokens read one step late) gives the
outputs of synchronous scheduling. It is on by default on CUDA only; these tests force it on the
CPU in float32, where the batch's composition cannot change the numbers."""
import pytest

from hearth_llm.engine import SamplingParams

from conftest import hf_greedy, random_prompts


def run_all(engine, prompts, params_list) -> list:
    ids = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    num_steps_ahead = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps_ahead += engine._in_flight is not None  # a step left running: the next one goes ahead
    assert (num_steps_ahead > 0) is engine.async_scheduling
    requests = [engine.groups[i][0] for i in ids]
    for request_id in ids:
        engine.release(request_id)
    return requests


MIXED = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=9, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, min_tokens=4, stop_token_ids=[5, 6, 7, 8, 9]),
    SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
]


def test_async_and_sync_scheduling_give_the_same_tokens(tiny_model_dirs, make_engine):
    path = tiny_model_dirs["qwen3"]
    prompts = random_prompts(len(MIXED), [9, 30, 3, 17], seed=11)
    results = []
    for is_async in (False, True):
        engine = make_engine(path, device="cpu", async_scheduling=is_async)
        assert engine.async_scheduling is is_async
        results.append(run_all(engine, prompts, MIXED))
    for sync_request, async_request in zip(*results):
        assert async_request.output_token_ids == sync_request.output_token_ids
        assert async_request.finish_reason == sync_request.finish_reason
        assert async_request.logprobs == sync_request.logprobs
        assert async_request.num_pending_tokens == 0


def test_async_scheduling_matches_hf_under_preemption(tiny_model_dirs, make_engine):
    path = tiny_model_dirs["mistral"]
    # 24 blocks of 4 tokens: eight requests cannot all stay, so some are preempted mid-decode.
    engine = make_engine(path, device="cpu", block_size=4, kv_cache_memory=24 * 2048, max_model_len=96,
                         async_scheduling=True)
    prompts = random_prompts(8, [30, 12, 25, 40], seed=7)
    requests = run_all(engine, prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 8)
    assert engine.stats()["num_preemptions"] > 0
    for prompt, request in zip(prompts, requests):
        assert request.output_token_ids == hf_greedy(path, prompt, 24)


@pytest.mark.parametrize("n", [1, 3])
def test_async_scheduling_stops_at_stop_tokens_without_extra_output(tiny_model_dirs, make_engine, n):
    path = tiny_model_dirs["llama"]
    prompt = random_prompts(1, [12], seed=5)[0]
    reference = hf_greedy(path, prompt, 16)
    stop = reference[5]
    engine = make_engine(path, device="cpu", async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop], n=n)
    request_id = engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    for child in engine.groups[request_id]:
        assert child.output_token_ids == reference[:reference.index(stop) + 1]
        assert child.finish_reason == "stop"
    engine.release(request_id)
