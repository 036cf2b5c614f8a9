"""AsyncLLM and the shared engine thread: streaming, cancellation, backpressure, timeouts, fault
isolation, a dead loop, several threads and loops on one engine, clean shutdown. Tiny models."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hearth_llm.engine import (AsyncLLM, EngineClosedError, EngineDeadError, EngineOverloadedError, RateLimit,
                               RequestFailedError, RequestTimeoutError, SamplingParams, get_engine)

from conftest import hf_greedy, random_prompts, record_steps_at_abort

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENDLESS = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
TINY_ENGINE = dict(show_progress=False, kv_cache_memory="16MiB")


async def wait_until_idle(llm: AsyncLLM, timeout: float = 10.0) -> dict:
    """The engine's counters once nothing runs or waits (or the last seen ones on timeout)."""
    deadline = time.monotonic() + timeout
    stats = llm.stats()
    while time.monotonic() < deadline:
        stats = llm.stats()
        if stats.get("num_running") == 0 and stats.get("num_waiting") == 0 and stats.get("num_queued") == 0:
            break
        await asyncio.sleep(0.01)
    return stats


@pytest.fixture
def make_async_llm(tiny_model_dirs):
    """A fresh engine per test; afterwards its KV pool must be whole and its thread gone."""
    created: list[AsyncLLM] = []

    def build(arch: str = "llama", **kwargs) -> AsyncLLM:
        llm = AsyncLLM(str(tiny_model_dirs[arch]), **{**TINY_ENGINE, **kwargs})
        created.append(llm)
        return llm

    yield build
    for llm in created:
        core = llm.core
        if not core.is_stopped:
            stats = asyncio.run(wait_until_idle(llm))
            assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
        core.close()
        assert not core._is_thread_alive()


async def collect(llm: AsyncLLM, prompt, params=GREEDY, **kwargs):
    return [out async for out in llm.generate(prompt, params, **kwargs)]


async def test_generate_streams_one_output_per_step_equal_to_hf(make_async_llm, tiny_model_dirs):
    llm = make_async_llm()
    prompt = random_prompts(1, [12], seed=3)[0]
    outputs = await collect(llm, prompt)
    assert [len(out.delta_token_ids) for out in outputs] == [1] * 8
    assert [t for out in outputs for t in out.delta_token_ids] == hf_greedy(tiny_model_dirs["llama"], prompt, 8)
    assert [out.finished for out in outputs] == [False] * 7 + [True]
    last = outputs[-1]
    assert last.finish_reason == "length" and last.prompt_token_ids == prompt
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (12, 8)
    assert all(out.usage is None for out in outputs[:-1])


async def test_construction_is_cheap_and_handles_share_one_engine(tiny_model_dirs):
    path = str(tiny_model_dirs["qwen2"])
    started = time.perf_counter()
    first = AsyncLLM(path, **TINY_ENGINE)
    second = AsyncLLM(path, kv_cache_memory="16MiB", show_progress=True)
    assert time.perf_counter() - started < 0.1
    assert first.core is second.core is get_engine(path, **TINY_ENGINE)
    assert not first.core._is_thread_alive()  # nothing loaded until the first request
    await collect(first, [5, 6, 7])
    first.close()
    assert first.core._is_thread_alive()  # the second handle still holds it
    with pytest.raises(EngineClosedError):
        await collect(first, [5, 6, 7])
    await collect(second, [5, 6, 7])
    second.close()
    assert not second.core._is_thread_alive()
    assert get_engine(path, **TINY_ENGINE) is not first.core  # a stopped engine is replaced


async def test_leaving_the_loop_after_three_outputs_frees_blocks_within_a_step(make_async_llm, monkeypatch):
    llm = make_async_llm()
    steps_at_abort = record_steps_at_abort(llm.core, monkeypatch)
    num_seen = 0
    async for _ in llm.generate([7] * 40, ENDLESS):
        num_seen += 1
        if num_seen == 3:
            break
    stats = await wait_until_idle(llm)
    assert len(steps_at_abort) == 1
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_steps"] - steps_at_abort[0] <= 2  # the step in flight, then the abort


async def test_cancelling_the_task_aborts_the_request(make_async_llm):
    llm = make_async_llm()
    started = asyncio.Event()

    async def consume():
        async for _ in llm.generate([9] * 30, ENDLESS):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await wait_until_idle(llm)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_generation_tokens"] < ENDLESS.max_tokens


async def test_asyncio_timeout_around_the_loop_aborts_the_request(make_async_llm):
    llm = make_async_llm()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(collect(llm, [9] * 30, ENDLESS), timeout=0.2)
    stats = await wait_until_idle(llm)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_request_timeout_raises_timeout_error_and_frees_blocks(make_async_llm):
    llm = make_async_llm()
    with pytest.raises(RequestTimeoutError, match="timeout=0.2") as raised:
        await collect(llm, [9] * 30, ENDLESS, timeout=0.2)
    assert isinstance(raised.value, TimeoutError)
    stats = await wait_until_idle(llm)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert len(await collect(llm, [9] * 30, timeout=30)) == 8  # still serving


async def test_abort_by_request_id_ends_the_stream_with_abort(make_async_llm):
    llm = make_async_llm()
    outputs = []
    async for out in llm.generate([4] * 20, ENDLESS, request_id="job-1"):
        outputs.append(out)
        if len(outputs) == 2:
            await llm.abort("job-1")
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert outputs[-1].usage.completion_tokens < ENDLESS.max_tokens


async def test_samples_of_n_arrive_with_their_index_and_one_final_usage(make_async_llm):
    llm = make_async_llm()
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True)
    outputs = await collect(llm, [3, 4, 5], params)
    assert sorted(out.index for out in outputs) == [0] * 4 + [1] * 4
    assert [out.finished for out in outputs].count(True) == 1 and outputs[-1].finished
    assert outputs[-1].usage.completion_tokens == 8


async def test_samples_finishing_in_the_same_step_each_get_their_last_tokens(make_async_llm):
    llm = make_async_llm()
    params = SamplingParams(n=16, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True)
    outputs = await collect(llm, [3, 4, 5], params)
    per_sample = {}
    for out in outputs:
        per_sample.setdefault(out.index, []).extend(out.delta_token_ids)
    assert sorted(per_sample) == list(range(16))
    assert all(len(tokens) == 3 for tokens in per_sample.values()), per_sample
    assert outputs[-1].finished and outputs[-1].usage.completion_tokens == 48


async def test_a_full_waiting_queue_raises_overloaded_at_once(make_async_llm):
    llm = make_async_llm(max_num_seqs=1, max_waiting_requests=2)
    streams = []
    with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
        for _ in range(4):
            streams.append(llm.core.add_request([5] * 10, ENDLESS))
    assert 2 <= len(streams) <= 3
    for stream in streams:
        stream.close()
    await wait_until_idle(llm)
    assert len(await collect(llm, [5] * 10)) == 8  # room again


async def test_add_requests_admits_all_before_the_next_step_or_none(make_async_llm):
    llm = make_async_llm()
    prompts = random_prompts(6, [4, 9], seed=6)
    streams = llm.core.add_requests(prompts, [GREEDY] * 6)
    outputs = [[out async for out in stream] for stream in streams]
    assert all(len(out) == 8 for out in outputs)
    assert (await wait_until_idle(llm))["num_steps"] == 8  # one prefill step for all six, seven decodes
    streams = llm.core.add_requests([[5, 6], [5, 10**6], [7]], [GREEDY] * 3)
    for stream in streams:
        with pytest.raises(ValueError, match="prompt token ids"):
            [out async for out in stream]
    stats = await wait_until_idle(llm)
    assert stats["num_steps"] == 8 and stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_invalid_input_fails_only_that_request(make_async_llm):
    llm = make_async_llm()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="timeout"):
        await collect(llm, [5, 6], timeout=0)
    with pytest.raises(ValueError, match="prompt token ids"):
        await collect(llm, [5, 10**6])
    good, bad = await asyncio.gather(collect(llm, [5, 6, 7]), collect(llm, []), return_exceptions=True)
    assert len(good) == 8 and isinstance(bad, ValueError)


async def test_a_failed_forward_pass_fails_its_requests_and_the_engine_keeps_serving(make_async_llm):
    llm = make_async_llm()
    await collect(llm, [5, 6])  # loaded
    runner = llm.core.engine.runner
    real_run = runner.run
    calls = []

    def fail_once(batch, *in_flight_tokens):  # with async scheduling the runner also gets the step in flight
        calls.append(len(batch.requests))
        if len(calls) == 1:
            raise RuntimeError("injected forward failure")
        return real_run(batch, *in_flight_tokens)

    runner.run = fail_once
    try:
        with pytest.raises(RequestFailedError, match="injected forward failure") as raised:
            await collect(llm, [5, 6, 7])
        assert isinstance(raised.value.__cause__, RuntimeError)
        assert len(await collect(llm, [5, 6, 7])) == 8
    finally:
        runner.run = real_run


async def test_a_dead_loop_fails_pending_and_later_calls_fast(make_async_llm):
    llm = make_async_llm()
    await collect(llm, [5, 6])
    scheduler = llm.core.engine.scheduler
    real_schedule = scheduler.schedule
    state = {"calls": 0}

    def die_on_third_step(*args, **kwargs):  # schedule(proposals=None) since speculative decoding
        state["calls"] += 1
        if state["calls"] == 3:
            raise RuntimeError("scheduler bug")
        return real_schedule(*args, **kwargs)

    scheduler.schedule = die_on_third_step
    with pytest.raises(EngineDeadError, match="scheduler bug"):
        await collect(llm, [5, 6, 7], ENDLESS)
    started = time.perf_counter()
    with pytest.raises(EngineDeadError, match="scheduler bug"):
        await collect(llm, [5, 6, 7])
    with pytest.raises(EngineDeadError):
        list(llm.core.add_request([5, 6, 7], GREEDY))
    assert time.perf_counter() - started < 0.5
    llm.core._thread.join(5)
    assert not llm.core._is_thread_alive()


async def test_a_new_handle_after_a_dead_loop_restarts_the_engine(make_async_llm):
    llm = make_async_llm()
    await collect(llm, [5, 6])
    llm.core.engine.scheduler.schedule = lambda: (_ for _ in ()).throw(RuntimeError("scheduler bug"))
    with pytest.raises(EngineDeadError):
        await collect(llm, [5, 6, 7])
    restarted = make_async_llm()  # the documented restart path: a new handle for the same model
    assert restarted.core is not llm.core
    assert len(await collect(restarted, [5, 6, 7])) == 8
    with pytest.raises(EngineDeadError):  # the old handle stays dead
        await collect(llm, [5, 6, 7])


async def test_a_model_that_fails_to_load_fails_calls_with_its_reason(tmp_path):
    llm = AsyncLLM(str(tmp_path / "missing.gguf"), **TINY_ENGINE)
    with pytest.raises(EngineDeadError, match="does not exist") as raised:
        await collect(llm, [5, 6])
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(EngineDeadError):
        await collect(llm, [5, 6])


async def test_threads_and_event_loops_share_one_engine(make_async_llm, tiny_model_dirs):
    llm = make_async_llm()
    prompts = random_prompts(6, [5, 9, 14], seed=4)
    expected = [hf_greedy(tiny_model_dirs["llama"], prompt, 8) for prompt in prompts]
    results: dict[int, list[int]] = {}

    def in_own_loop(index):  # e.g. a Jupyter kernel's loop next to the app's
        outputs = asyncio.run(collect(llm, prompts[index]))
        results[index] = [t for out in outputs for t in out.delta_token_ids]

    def blocking(index):  # a plain thread, no event loop at all
        results[index] = [t for out in llm.core.add_request(prompts[index], GREEDY) for t in out.delta_token_ids]

    threads = [threading.Thread(target=in_own_loop, args=(i,)) for i in (0, 1)]
    threads += [threading.Thread(target=blocking, args=(i,)) for i in (2, 3)]
    for thread in threads:
        thread.start()
    mine = await asyncio.gather(collect(llm, prompts[4]), collect(llm, prompts[5]))
    for thread in threads:
        thread.join(30)
    for index, outputs in zip((4, 5), mine):
        results[index] = [t for out in outputs for t in out.delta_token_ids]
    assert [results[i] for i in range(6)] == expected


async def test_the_event_loop_keeps_running_while_the_model_works(make_async_llm):
    llm = make_async_llm()
    ticks = 0

    async def heartbeat():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    beat = asyncio.create_task(heartbeat())
    started = time.perf_counter()
    await asyncio.gather(*(collect(llm, [5] * 50, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
                           for _ in range(4)))
    elapsed = time.perf_counter() - started
    beat.cancel()
    assert ticks >= elapsed / 0.005 / 4  # the loop was free most of the time


async def test_tenant_rate_limit_delays_only_that_tenant(make_async_llm):
    llm = make_async_llm(rate_limit=RateLimit(max_requests=2, period_s=0.5))
    params = SamplingParams(temperature=0, max_tokens=1)

    async def timed(tenant):
        await collect(llm, [5, 6], params, tenant=tenant)
        return time.perf_counter()

    await collect(llm, [5, 6], params)  # load the model first
    started = time.perf_counter()
    finished_a = await asyncio.gather(*(timed("a") for _ in range(3)))
    finished_b = await asyncio.gather(*(timed("b") for _ in range(2)))
    assert max(finished_a) - started >= 0.5  # the third request of "a" waited for the window
    assert sorted(finished_a)[1] - started < 0.5
    assert max(finished_b) - max(finished_a) < 0.5  # "b" had its own window
    with pytest.raises(ValueError, match="max_requests"):
        RateLimit(max_requests=0)


def test_context_manager_close_stops_the_thread(tiny_model_dirs):
    with AsyncLLM(str(tiny_model_dirs["mistral"]), **TINY_ENGINE) as llm:
        outputs = list(llm.core.add_request([5, 6, 7], GREEDY))
        assert outputs[-1].finished
        thread = llm.core._thread
    assert not thread.is_alive()
    with pytest.raises(EngineClosedError):
        llm.core.add_request([5, 6], GREEDY)


def test_interpreter_exit_stops_engines_that_were_never_closed(tiny_model_dirs):
    script = textwrap.dedent(f"""
        import atexit, threading
        # Registered first, so it runs last: after hearth's own exit handler.
        atexit.register(lambda: print("left:", [t.name for t in threading.enumerate() if t.name.startswith("hearth")]))
        from hearth_llm.engine import AsyncLLM, SamplingParams
        llm = AsyncLLM({str(tiny_model_dirs["llama"])!r}, show_progress=False, kv_cache_memory="16MiB")
        stream = llm.core.add_request([5, 6, 7], SamplingParams(max_tokens=900, ignore_eos=True))
        print("first:", len(next(iter(stream)).delta_token_ids))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["first: 1", "left: []"]
