"""The memory budget, shrink and sleep/wake on CUDA (skipped without a GPU): weights go to pinned
host memory and back, the device memory really returns (``torch.cuda.mem_get_info``), CUDA graphs
are captured again on wake and after a shrink, and a request in flight on one engine (async
scheduling) survives another engine's load shrinking its cache (its steps slowed down until then: on
an H200 the request would end before the second engine has loaded)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from hearth_llm.engine import LLM, SamplingParams, memory_report
from hearth_llm.engine.memory import budget as budget_module
from hearth_llm.engine.memory.budget import MemoryBudget

from conftest import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture
def fresh_gpu_budget(monkeypatch):
    def install(capacity_bytes: int) -> MemoryBudget:
        device = torch.device("cuda", torch.cuda.current_device())
        budget = MemoryBudget(device, capacity_bytes)
        monkeypatch.setitem(budget_module._budgets, str(device), budget)
        return budget

    return install


@pytest.fixture
def gpu_llms():
    created = []

    def build(path, **kwargs) -> LLM:
        # float32: greedy tokens compared across batch compositions stay put
        llm = LLM(str(path), device="cuda", dtype="float32", show_progress=False, **kwargs)
        created.append(llm)
        return llm

    yield build
    for llm in created:
        llm.close()


def tokens(llm: LLM, prompts) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_level_1_moves_the_weights_to_pinned_memory_and_wakes_token_equal(tiny_model_dirs, fresh_gpu_budget,
                                                                           gpu_llms):
    fresh_gpu_budget(2 << 30)
    llm = gpu_llms(tiny_model_dirs["llama"], kv_cache_memory="256MiB")
    prompts = random_prompts(4, [5, 17, 40, 3], seed=1)
    awake = tokens(llm, prompts)
    assert llm.engine.runner.decode_graphs is not None
    held = llm.stats()["weights_bytes"] + llm.stats()["kv_cache_bytes"]
    torch.cuda.synchronize()
    allocated, free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    llm.sleep(level=1)
    weight = llm.engine.runner.model.lm_head.weight
    assert weight.device.type == "cpu" and weight.is_pinned()
    assert allocated - torch.cuda.memory_allocated() >= 0.9 * held
    assert torch.cuda.mem_get_info()[0] - free >= 0.9 * (256 << 20)        # back to the device
    assert llm.stats()["weights_bytes"] == 0 == llm.stats()["kv_cache_bytes"]
    assert tokens(llm, prompts) == awake
    assert llm.engine.runner.model.lm_head.weight.device.type == "cuda"
    assert llm.engine.runner.decode_graphs is not None                     # captured again


def test_level_2_drops_the_weights_and_reloads_them(tiny_model_dirs, fresh_gpu_budget, gpu_llms):
    fresh_gpu_budget(2 << 30)
    llm = gpu_llms(tiny_model_dirs["qwen3"], kv_cache_memory="64MiB")
    prompts = random_prompts(3, [9, 30, 2], seed=2)
    awake = tokens(llm, prompts)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    llm.sleep(level=2)
    assert llm.engine.runner.model is None
    assert allocated - torch.cuda.memory_allocated() >= 0.9 * (64 << 20)
    assert tokens(llm, prompts) == awake


def slowed_until(engine, event: threading.Event, seconds: float = 0.03) -> None:
    """Each of ``engine``'s steps waits ``seconds`` first until ``event`` is set: an H200 runs a tiny
    model's 200 decode steps before a second engine has loaded, and the shrink must come mid-request."""
    step = engine.step

    def slow_step():
        event.wait(seconds)
        return step()

    engine.step = slow_step


def test_a_second_engine_shrinks_the_first_while_it_serves(tiny_model_dirs, fresh_gpu_budget, gpu_llms):
    llama, qwen2 = tiny_model_dirs["llama"], tiny_model_dirs["qwen2"]
    budget = fresh_gpu_budget(64 << 20)
    first = gpu_llms(llama)                                   # auto-sized: takes the whole budget
    prompts = random_prompts(3, [8, 21, 50], seed=3)
    expected_first = tokens(first, prompts)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    expected_long = first.generate([prompts[1]], long, use_tqdm=False)[0].outputs[0].token_ids
    full_blocks = first.stats()["num_total_blocks"]
    generated_before = first.stats()["num_generation_tokens"]
    second_loaded = threading.Event()
    slowed_until(first.engine, second_loaded)                 # >= 6 s for the 200 tokens until then
    started = time.monotonic()
    reading = iter(first._core.add_request(prompts[1], long))
    head = next(reading).delta_token_ids
    second = gpu_llms(qwen2)                                  # shrinks the first between two of its steps
    shrunk, load_s = first.stats(), time.monotonic() - started
    second_loaded.set()
    assert shrunk["num_total_blocks"] < full_blocks           # counted by the shrink itself, not the next step
    assert first.engine.kv_cache.num_total_blocks == shrunk["num_total_blocks"]
    assert shrunk["num_generation_tokens"] - generated_before < 200, f"the request ended first ({load_s:.1f} s)"
    assert head + [t for out in reading for t in out.delta_token_ids] == expected_long
    assert tokens(first, prompts) == expected_first
    assert tokens(second, prompts) and budget.num_reserved_bytes <= budget.capacity_bytes
    assert first.engine.runner.decode_graphs is not None
    assert [e["name"] for e in memory_report()[str(budget.device)]["engines"]] == ["engine 'llama'", "engine 'qwen2'"]


def test_one_engine_wakes_and_captures_while_another_serves(tiny_model_dirs, fresh_gpu_budget, gpu_llms):
    fresh_gpu_budget(2 << 30)
    sleeper = gpu_llms(tiny_model_dirs["llama"], kv_cache_memory="128MiB")
    busy = gpu_llms(tiny_model_dirs["qwen2"], kv_cache_memory="128MiB")
    prompts = random_prompts(16, [5, 33], seed=4)
    expected_sleeper, expected_busy = tokens(sleeper, prompts[:4]), tokens(busy, prompts)
    sleeper.sleep(level=1)
    results = {}
    serving = threading.Thread(target=lambda: results.setdefault("busy", [tokens(busy, prompts) for _ in range(3)]))
    serving.start()
    results["sleeper"] = tokens(sleeper, prompts[:4])          # wakes (and captures graphs) meanwhile
    serving.join(120)
    assert results["sleeper"] == expected_sleeper
    assert results["busy"] == [expected_busy] * 3
