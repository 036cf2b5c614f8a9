"""Stress: many streamed requests with random cancellations, timeouts, priorities and shared
prefixes over a KV pool small enough to force preemption. Afterwards: no leaked block, no hung
request, and every completed greedy output equals its solo run.

``python -m pytest tests/test_stress.py --stress-requests 2000`` is the long run."""
import asyncio
import random
import time

import pytest

from hearth_llm.engine import AsyncLLM, EngineConfig, LLMEngine, RequestTimeoutError, SamplingParams

from conftest import TINY_VOCAB


def solo_outputs(model_dir, prompts, max_tokens):
    """Each prompt alone through a fresh engine with a roomy cache: the reference."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), show_progress=False))
    results = {}
    for key, prompt in prompts.items():
        request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens[key],
                                                               ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        results[key] = engine.groups[request_id][0].output_token_ids
        engine.release(request_id)
    return results


def test_streaming_stress_with_cancellations_timeouts_and_preemption(tiny_model_dirs, request):
    num_requests = request.config.getoption("--stress-requests")
    rng = random.Random(0)
    shared_prefixes = [[rng.randrange(4, TINY_VOCAB) for _ in range(24)] for _ in range(4)]
    prompts, max_tokens, plans = {}, {}, {}
    for index in range(num_requests):
        prefix = rng.choice(shared_prefixes) if rng.random() < 0.6 else []
        prompts[index] = prefix + [rng.randrange(4, TINY_VOCAB) for _ in range(rng.randint(1, 30))]
        max_tokens[index] = rng.randint(1, 24)
        roll = rng.random()
        plans[index] = ("cancel", rng.randint(0, 6)) if roll < 0.3 else ("timeout", None) if roll < 0.4 else ("run", None)
    llm = AsyncLLM(str(tiny_model_dirs["llama"]), block_size=4, kv_cache_memory=48 * 2048, max_model_len=96,
                   max_num_seqs=32, max_num_batched_tokens=64, show_progress=False)
    outcomes = {}

    async def one(index):
        await asyncio.sleep(rng.random() * 0.5)
        params = SamplingParams(temperature=0, max_tokens=max_tokens[index], ignore_eos=True)
        kind, cancel_after = plans[index]
        tokens = []
        try:
            timeout = 0.05 if kind == "timeout" else None
            async for out in llm.generate(prompts[index], params, priority=index % 3, timeout=timeout):
                tokens.extend(out.delta_token_ids)
                if kind == "cancel" and len(tokens) >= cancel_after:
                    outcomes[index] = ("cancelled", tokens)
                    return  # leaving the loop aborts the request
                if out.finished:
                    outcomes[index] = (out.finish_reason, tokens)
        except RequestTimeoutError:
            outcomes[index] = ("timed out", tokens)

    async def main():
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(num_requests))), timeout=600)

    started = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - started
    # The engine processes aborts before its next step; give it that step.
    deadline = time.monotonic() + 10
    while llm.stats().get("num_running", 0) + llm.stats().get("num_waiting", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = llm.stats()
    llm.close()

    assert len(outcomes) == num_requests, "some requests never finished"
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_preemptions"] > 0
    completed = {i: tokens for i, (reason, tokens) in outcomes.items() if reason == "length"}
    counts = {kind: sum(1 for reason, _ in outcomes.values() if reason == kind)
              for kind in ("length", "cancelled", "timed out", "abort")}
    print(f"\n{num_requests} requests in {elapsed:.1f} s: {counts}, preemptions {stats['num_preemptions']}")
    assert counts["cancelled"] > 0 and completed
    reference = solo_outputs(tiny_model_dirs["llama"], {i: prompts[i] for i in completed}, max_tokens)
    mismatched = [i for i in completed if completed[i] != reference[i]]
    assert not mismatched, f"{len(mismatched)} completed outputs differ from their solo runs"
