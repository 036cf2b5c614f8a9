"""One memory budget per device for every engine in the process; sleep and wake; keep_alive.

Each test that loads engines gets a fresh CPU budget (``fresh_cpu_budget``), so the engines other
tests keep alive are neither counted nor shrunk. Tiny models: the llama of conftest holds 8 KiB
of KV per 16-token block in float32.
"""
from __future__ import annotations

import gc
import io
import json
import os
import sys
import threading
import time
import weakref
from argparse import Namespace
from contextlib import redirect_stdout

import pytest
import torch
from torch import nn

from hearth_llm.engine import LLM, EngineConfig, MemoryBudgetError, SamplingParams, get_engine, memory_report
from hearth_llm.engine.loader import load_checkpoint
from hearth_llm.engine.memory import budget as budget_module
from hearth_llm.engine.memory import plan_load, set_memory_budget
from hearth_llm.engine.memory.budget import MemoryBudget
from hearth_llm.engine.memory.kv_cache import kv_floor_blocks, shrink_kv_cache
from hearth_llm.engine.memory.weights import offload_weights, weights_bytes
from hearth_llm.engine.model_runner import ModelRunner

from conftest import hf_greedy, random_prompts

KIB = 1 << 10
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def fresh_cpu_budget(monkeypatch):
    """Install an empty CPU budget of the given size for this test only."""

    def install(capacity_bytes: int) -> MemoryBudget:
        budget = MemoryBudget(torch.device("cpu"), capacity_bytes)
        monkeypatch.setitem(budget_module._budgets, "cpu", budget)
        return budget

    return install


@pytest.fixture
def llms():
    created = []

    def build(path, **kwargs) -> LLM:
        llm = LLM(str(path), dtype="float32", show_progress=False, **kwargs)
        created.append(llm)
        return llm

    yield build
    for llm in created:
        llm.close()


def planned_weights(path) -> int:
    """What a load books before reading weights (the test budgets are sized from it)."""
    return plan_load(load_checkpoint(str(path), torch.float32, progress=False),
                     EngineConfig(model=str(path), dtype="float32")).weights_bytes


def tokens(llm: LLM, prompts) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


# ---- the budget on its own -------------------------------------------------------------------------

class FakeEngine:
    """A budget holder with ``free`` bytes of free KV it gives back on demand."""

    def __init__(self, name: str, free: int = 0) -> None:
        self.name, self.free, self.budget = name, free, None

    def reclaimable_kv_bytes(self) -> int:
        return self.free

    def release_kv(self, num_bytes: int) -> int:
        given = min(num_bytes, self.free)
        self.free -= given
        booking = self.budget.booking_of(self)
        self.budget.book(self, booking.weights_bytes, booking.kv_cache_bytes - given)
        return given


def test_a_newcomer_that_fits_gets_what_it_wants_without_shrinking_anyone():
    budget = MemoryBudget(torch.device("cpu"), 100 * KIB)
    first = FakeEngine("first", free=40 * KIB)
    first.budget = budget
    assert budget.reserve(first, 10 * KIB, 50 * KIB, 10 * KIB) == 50 * KIB
    second = FakeEngine("second")
    assert budget.reserve(second, 10 * KIB, 30 * KIB, 10 * KIB) == 30 * KIB
    assert first.free == 40 * KIB and budget.num_unreserved_bytes == 0


def test_a_newcomer_takes_free_kv_back_up_to_an_equal_share():
    budget = MemoryBudget(torch.device("cpu"), 100 * KIB)
    first = FakeEngine("first", free=80 * KIB)
    first.budget = budget
    assert budget.reserve(first, 10 * KIB, None, 10 * KIB) == 90 * KIB   # all of it: nobody else is here
    second = FakeEngine("second")
    granted = budget.reserve(second, 10 * KIB, None, 10 * KIB)
    assert granted == 40 * KIB                                           # (100 - 10 - 10) / 2
    assert budget.booking_of(first).kv_cache_bytes == 40 * KIB and budget.num_unreserved_bytes == 0   # equal shares


def test_a_refusal_names_the_need_and_the_holders_and_shrinks_nobody():
    budget = MemoryBudget(torch.device("cpu"), 100 * KIB)
    first = FakeEngine("chat-a", free=20 * KIB)
    first.budget = budget
    budget.reserve(first, 30 * KIB, 60 * KIB, 10 * KIB)
    newcomer = FakeEngine("chat-b")
    with pytest.raises(MemoryBudgetError) as refused:
        budget.reserve(newcomer, 20 * KIB, None, 20 * KIB, what="1024 tokens")
    message = str(refused.value)
    assert "chat-b does not fit the cpu memory budget: it needs at least 40.0 KiB (weights 20.0 KiB + KV cache " \
           "20.0 KiB for 1024 tokens); the budget of 100.0 KiB has 10.0 KiB unreserved and 20.0 KiB in free KV " \
           "blocks" in message
    assert "Held: chat-a: weights 30.0 KiB + KV cache 60.0 KiB (20.0 KiB of it free)" in message
    assert first.free == 20 * KIB and budget.booking_of(newcomer) is None   # nobody shrunk, nothing booked


def test_set_memory_budget_checks_its_arguments():
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="bytes_or_fraction"):
            set_memory_budget("cpu", bad)
    with pytest.raises(ValueError, match="bytes_or_fraction"):
        set_memory_budget("cpu", "lots")
    with pytest.raises(ValueError, match="device"):
        set_memory_budget("tpu", "1GiB")


def test_a_smaller_budget_is_refused_when_the_engines_cannot_give_enough_back(fresh_cpu_budget):
    budget = fresh_cpu_budget(100 * KIB)
    holder = FakeEngine("held", free=10 * KIB)
    holder.budget = budget
    budget.reserve(holder, 50 * KIB, 40 * KIB, 0)
    with pytest.raises(MemoryBudgetError, match="held: weights"):
        set_memory_budget("cpu", 60 * KIB)
    assert budget.capacity_bytes == 100 * KIB
    set_memory_budget("cpu", 80 * KIB)                          # the 10 KiB free suffice
    assert budget.capacity_bytes == 80 * KIB and holder.free == 0


# ---- weights in host memory and back ------------------------------------------------------------

class TiedWithViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight                    # tied
        self.packed = (self.embed.weight.detach()[:5], torch.arange(3.0))   # a view and a tuple


def test_offloading_keeps_tied_weights_tied_and_views_views():
    model = TiedWithViews()
    expected = model.embed.weight.detach().clone()
    offloaded = offload_weights(model, pin_memory=False)
    assert offloaded.num_bytes == weights_bytes(model) == 10 * 4 * 4 + 3 * 4
    offloaded.restore(torch.device("cpu"))
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, expected)
    assert model.packed[0].untyped_storage().data_ptr() == model.embed.weight.untyped_storage().data_ptr()
    assert torch.equal(model.packed[1], torch.arange(3.0))


def test_offloading_a_loaded_model_and_back_keeps_its_greedy_tokens(tiny_model_dirs, fresh_cpu_budget, llms):
    """What level 1 does to a GPU model's weights, done here host to host."""
    fresh_cpu_budget(64 * 2**20)
    llm = llms(tiny_model_dirs["qwen3"], kv_cache_memory="1MiB")
    prompts = random_prompts(2, [6, 19], seed=7)
    expected = tokens(llm, prompts)
    with llm._core._step_lock:
        model = llm.engine.runner.model
        storage = model.lm_head.weight.untyped_storage().data_ptr()
        offloaded = offload_weights(model, torch.device("cpu"), pin_memory=False)
        assert model.lm_head.weight.untyped_storage().data_ptr() != storage      # really moved
        assert offloaded.num_bytes == weights_bytes(model) == llm.stats()["weights_bytes"]
        offloaded.restore()
    assert tokens(llm, prompts) == expected


# ---- shrinking a live KV cache ------------------------------------------------------------------

def test_shrinking_moves_a_running_requests_blocks_and_keeps_the_prefix_cache(tiny_model_dirs, make_engine):
    path = tiny_model_dirs["llama"]
    engine = make_engine(path, dtype="float32", kv_cache_memory=64 * 8 * KIB, max_model_len=128)
    long_prompt, short_prompt = random_prompts(2, [100, 20], seed=3)
    long_id = engine.add_request(long_prompt, GREEDY)              # blocks 0..6
    short_id = engine.add_request(short_prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    outputs = [d for d in engine.step() if d.request.request_id == short_id]   # both prefilled
    short = engine.requests[short_id]
    old_blocks = list(short.block_ids)
    engine.abort_request(long_id)                                  # its 6 full blocks stay prefix-cached, free
    engine.release(long_id)
    assert shrink_kv_cache(engine, 12) == 64 - 12
    assert engine.kv_cache.num_total_blocks == 12 == engine.runner.kv_cache.shape[2]
    assert short.block_ids != old_blocks and max(short.block_ids) < 12     # renumbered into the smaller cache
    while engine.has_unfinished_requests():
        outputs += [d for d in engine.step() if d.request.request_id == short_id]
    generated = [t for delta in outputs for t in delta.new_token_ids]
    assert generated == hf_greedy(path, short_prompt, 30)
    engine.release(short_id)
    hits = engine.kv_cache.prefix_cache_hits
    again = engine.add_request(long_prompt, GREEDY)                # its cached blocks survived the shrink
    while engine.has_unfinished_requests():
        engine.step()
    engine.release(again)
    assert engine.kv_cache.prefix_cache_hits - hits == 6 * 16
    assert shrink_kv_cache(engine, 1) == 12 - kv_floor_blocks(engine)        # never below one max_model_len


# ---- engines sharing one budget ------------------------------------------------------------------

def test_two_chat_models_and_an_embedder_share_a_budget_and_a_third_model_is_refused(
        tiny_model_dirs, fresh_cpu_budget, llms):
    from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine

    llama, qwen2, qwen3 = (tiny_model_dirs[name] for name in ("llama", "qwen2", "qwen3"))
    minimum = 64 * 8 * KIB                        # 1024 tokens of the tiny models' KV
    budget = fresh_cpu_budget(1 << 30)
    embedder = EmbeddingEngine(EmbeddingConfig(dtype="float32"))
    try:
        embedder.embed(["booked first"])
        room = 3 * minimum + 256 * KIB            # the two chat models at full cache would need 2 x 1 GiB
        set_memory_budget("cpu", budget.num_reserved_bytes + room + planned_weights(llama) + planned_weights(qwen2))
        first = llms(llama)
        full_blocks = first.stats()["num_total_blocks"]
        long_prompt = random_prompts(1, [24], seed=1)[0]
        # Long enough to still run while the next model loads (200 tokens could finish first: 1 run in 3
        # failed here); 24 + 960 tokens stay inside the 1024-token floor a shrink keeps.
        in_flight = first._core.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=960, ignore_eos=True))
        reading = iter(in_flight)
        first_tokens = next(reading).delta_token_ids                     # running while the next model loads
        second = llms(qwen2)                                              # shrinks the first's free blocks
        assert first.stats()["num_total_blocks"] < full_blocks
        assert first.stats()["num_generation_tokens"] < 960   # it was shrunk mid-request
        generated = first_tokens + [t for out in reading for t in out.delta_token_ids]
        assert generated == hf_greedy(llama, long_prompt, 960)           # never dropped, never disturbed
        prompts = random_prompts(2, [9, 17], seed=2)
        assert tokens(first, prompts) == [hf_greedy(llama, p, GREEDY.max_tokens) for p in prompts]
        assert tokens(second, prompts) == [hf_greedy(qwen2, p, GREEDY.max_tokens) for p in prompts]
        assert budget.num_reserved_bytes <= budget.capacity_bytes
        names = [engine["name"] for engine in memory_report()["cpu"]["engines"]]
        assert names == ["embedding engine 'default'", "engine 'llama'", "engine 'qwen2'"]
        shrunk = first.stats()["num_total_blocks"]
        with pytest.raises(MemoryBudgetError) as refused:
            llms(qwen3)
        message = str(refused.value)
        assert "engine 'qwen3' does not fit the cpu memory budget" in message and "for 1024 tokens" in message
        assert "engine 'llama': weights" in message and "embedding engine 'default': weights" in message
        assert first.stats()["num_total_blocks"] == shrunk                  # a refusal shrinks nobody
        assert len(memory_report()["cpu"]["engines"]) == 3                  # and leaves nothing booked
        gc.collect()
        assert not [o for o in gc.get_objects() if type(o) is ModelRunner and o.arch.head_dim == 32]   # qwen3
        assert embedder.embed(["still serving"]).shape[0] == 1
    finally:
        embedder.close()


def test_a_model_whose_weights_exceed_the_budget_is_refused_before_loading(tiny_model_dirs, fresh_cpu_budget):
    path = tiny_model_dirs["llama"]
    fresh_cpu_budget(planned_weights(path) // 2)
    started = time.monotonic()
    with pytest.raises(MemoryBudgetError, match=r"needs at least .* \(weights"):
        LLM(str(path), dtype="float32", show_progress=False)
    assert memory_report()["cpu"]["engines"] == []
    assert time.monotonic() - started < 10


# ---- sleep and wake ------------------------------------------------------------------------------------

def test_sleep_and_wake_give_the_same_greedy_tokens_and_release_the_memory(tiny_model_dirs, fresh_cpu_budget,
                                                                            llms):
    path = tiny_model_dirs["llama"]
    budget = fresh_cpu_budget(64 * 2**20)
    llm = llms(path, kv_cache_memory="1MiB")
    prompts = random_prompts(3, [5, 11, 30], seed=4)
    awake = tokens(llm, prompts)
    cache = weakref.ref(llm.engine.runner.kv_cache)
    weight = weakref.ref(llm.engine.runner.model.lm_head.weight)
    llm.sleep(level=1)
    assert llm.stats()["is_sleeping"] and llm.stats()["kv_cache_bytes"] == 0 and cache() is None
    assert budget.booking_of(llm._core._memory).weights_bytes > 0    # level 1 on the CPU: weights stay
    assert tokens(llm, prompts) == awake                                # a request wakes it
    assert not llm.stats()["is_sleeping"] and llm.stats()["kv_cache_bytes"] == 1 << 20
    llm.sleep(level=2)
    assert weight() is None and budget.num_reserved_bytes == 0
    assert tokens(llm, prompts) == awake                                # reloaded from the checkpoint
    assert llm.stats()["weights_bytes"] > 0


def test_sleep_waits_for_the_running_request(tiny_model_dirs, fresh_cpu_budget, llms):
    fresh_cpu_budget(64 * 2**20)
    llm = llms(tiny_model_dirs["llama"], kv_cache_memory="1MiB")
    prompt = random_prompts(1, [12], seed=5)[0]
    stream = llm._core.add_request(prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    reading = iter(stream)
    first = next(reading)
    sleeper = threading.Thread(target=llm.sleep, args=(1,))
    sleeper.start()
    rest = [t for out in reading for t in out.delta_token_ids]
    sleeper.join(10)
    assert first.delta_token_ids + rest == hf_greedy(tiny_model_dirs["llama"], prompt, 48)
    assert not sleeper.is_alive() and llm.stats()["is_sleeping"]


def test_keep_alive_puts_an_idle_engine_to_sleep_and_a_request_wakes_it(tiny_model_dirs, fresh_cpu_budget,
                                                                         llms):
    fresh_cpu_budget(64 * 2**20)
    path = tiny_model_dirs["llama"]
    llm = llms(path, kv_cache_memory="1MiB", keep_alive=0.6)
    prompts = random_prompts(1, [7], seed=6)
    awake = tokens(llm, prompts)
    assert not llm.stats()["is_sleeping"]                     # just served: not idle for 0.6 s yet
    deadline = time.monotonic() + 10
    while not llm.stats()["is_sleeping"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.stats()["is_sleeping"] and llm.stats()["kv_cache_bytes"] == 0
    assert tokens(llm, prompts) == awake
    core = get_engine(str(path), dtype="float32", kv_cache_memory="1MiB", keep_alive=None)
    assert core is llm._core and core.keep_alive is None      # the last handle's keep_alive wins


def test_level_2_sleep_returns_the_weights_pages(tmp_path, fresh_cpu_budget, llms):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from conftest import TINY_COMMON, tiny_tokenizer

    config = LlamaConfig(**{**TINY_COMMON, "hidden_size": 512, "intermediate_size": 2048},
                         architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    fresh_cpu_budget(256 * 2**20)
    llm = llms(tmp_path, kv_cache_memory="1MiB")
    num_weight_bytes = llm.stats()["weights_bytes"]
    assert num_weight_bytes > 30 * 2**20
    gc.collect()
    before = _rss_bytes()
    llm.sleep(level=2)
    assert before - _rss_bytes() > num_weight_bytes // 2      # loosely: allocator slack is allowed


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- reporting -----------------------------------------------------------------------------------

def test_info_lists_the_engines_memory(tiny_model_dirs, fresh_cpu_budget):
    from hearth_llm.engine.cli import info

    fresh_cpu_budget(64 * 2**20)
    path = tiny_model_dirs["llama"]
    out = io.StringIO()
    with redirect_stdout(out):
        info(Namespace(model=str(path)))
    report = json.loads(out.getvalue())["memory"]["cpu"]
    (engine,) = report["engines"]
    assert engine["name"] == "engine 'llama'" and engine["weights_bytes"] > 0 and engine["kv_cache_bytes"] > 0
    assert report["capacity_bytes"] == 64 * 2**20
    get_engine(str(path)).close()


def test_level_2_sleep_is_refused_with_lora_and_the_engine_keeps_serving(tiny_model_dirs, fresh_cpu_budget, llms):
    fresh_cpu_budget(64 * 2**20)
    llm = llms(tiny_model_dirs["llama"], kv_cache_memory="1MiB", enable_lora=True)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.sleep(level=2)
    assert not llm.stats()["is_sleeping"]
    llm.sleep(level=1)
    assert llm.stats()["is_sleeping"]


def test_chat_hearth_and_hearth_llm_pass_keep_alive_to_the_shared_engine(tiny_model_dirs):
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from langchain_core.messages import HumanMessage

    from hearth_llm.integrations.langchain import ChatHearth
    from hearth_llm.integrations.llama_index import HearthLLM

    path, engine_kwargs = str(tiny_model_dirs["llama"]), {"dtype": "float32", "kv_cache_memory": "1MiB"}
    core = get_engine(path, **engine_kwargs)
    try:
        ChatHearth(model=path, keep_alive="5m", engine_kwargs=engine_kwargs)._prepare([HumanMessage("hi")], None, {})
        assert core.keep_alive == 300
        assert HearthLLM(model=path, keep_alive=2, engine_kwargs=engine_kwargs).core is core
        assert core.keep_alive == 2
    finally:
        core.close()


def _resident_kib(tensor: torch.Tensor) -> int:
    """KiB of the mappings over ``tensor``'s bytes that are resident (Linux /proc/self/smaps)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, overlaps = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                low, high = (int(bound, 16) for bound in fields[0].split("-"))
                overlaps = low < end and high > start
            elif overlaps and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_a_cpu_kv_cache_makes_resident_only_the_pages_its_slots_touch():
    # numpy asks for transparent huge pages on large arrays; then one write per layer would make 2 MiB of
    # each layer's cache resident. The pool opts out: a slot's write touches its own 4 KiB page.
    from hearth_llm.engine.memory.kv_cache import new_kv_cache

    cache = new_kv_cache((30, 2, 182, 16, 3, 64), torch.bfloat16, torch.device("cpu"))  # SmolLM2's 64 MiB pool
    assert torch.count_nonzero(cache[:, :, 100]) == 0  # zeros (untouched pages read as zeros)
    before = _resident_kib(cache)
    for layer in range(30):
        cache[layer, 0, 7, :4] = 1.0  # one 4-token write per layer into block 7
        cache[layer, 1, 7, :4] = 1.0
    assert _resident_kib(cache) - before <= 60 * 8  # a page or two per write, not 2 MiB per layer
    assert float(cache[3, 1, 7, 2].sum()) == 3 * 64
