"""Stress: many streamed requests with random cancellations, timeouts, priorities and shared
prefixes over a KV pool small enough to force preemption, once clean and once with faults
injected (forward passes and detokenization raising on random steps). Afterwards: no leaked
block, no hung request, every completed greedy output equals its solo run, and the engine
still serves.

``python -m pytest -s tests/test_stress.py --stress-requests 2000`` is the long run."""
import asyncio
import random
import time

import pytest

from hearth_llm.engine import (AsyncLLM, EngineConfig, LLMEngine, RequestFailedError, RequestTimeoutError,
                               SamplingParams)

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


class FaultInjector:
    """Makes the engine's forward pass and its detokenizers raise on random steps (seeded)."""

    def __init__(self, engine, forward_failure_rate: float, detokenize_failure_rate: float, seed: int = 1):
        rng = random.Random(seed)
        self.num_forward_failures = 0
        self.num_detokenize_failures = 0
        self._runner, self._real_run = engine.runner, engine.runner.run
        self._engine, self._real_detokenizers = engine, engine.detokenizers
        injector = self

        def run(*args, **kwargs):
            if rng.random() < forward_failure_rate:
                injector.num_forward_failures += 1
                raise RuntimeError("injected forward failure")
            return injector._real_run(*args, **kwargs)

        class FailingDetokenizers(dict):
            def __setitem__(self, request_id, detokenizer):
                real_add_token = detokenizer.add_token

                def add_token(*args, **kwargs):
                    if rng.random() < detokenize_failure_rate:
                        injector.num_detokenize_failures += 1
                        raise RuntimeError("injected detokenize failure")
                    return real_add_token(*args, **kwargs)

                detokenizer.add_token = add_token
                super().__setitem__(request_id, detokenizer)

        engine.runner.run = run
        engine.detokenizers = FailingDetokenizers(engine.detokenizers)

    def remove(self) -> None:
        self._runner.run = self._real_run
        remaining = dict(self._engine.detokenizers)
        self._engine.detokenizers = self._real_detokenizers
        self._engine.detokenizers.update(remaining)


@pytest.mark.parametrize("with_faults", [False, True], ids=["clean", "faults"])
def test_streaming_stress_with_cancellations_timeouts_and_preemption(tiny_model_dirs, request, with_faults):
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
    injector = None

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
        except RequestFailedError as error:
            assert "injected" in str(error) and injector is not None, error
            outcomes[index] = ("failed", tokens)

    async def main():
        nonlocal injector
        await llm.generate([5, 6], SamplingParams(max_tokens=1)).__anext__()  # loaded
        if with_faults:
            injector = FaultInjector(llm.core.engine, forward_failure_rate=0.03, detokenize_failure_rate=0.002)
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(num_requests))), timeout=600)
        if injector is not None:
            injector.remove()
        # still serving: a fresh request completes
        fresh = [out async for out in llm.generate([7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))]
        assert sum(len(out.delta_token_ids) for out in fresh) == 4

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
              for kind in ("length", "cancelled", "timed out", "failed", "abort")}
    faults = "" if injector is None else (f", faults injected: {injector.num_forward_failures} forward, "
                                          f"{injector.num_detokenize_failures} detokenize")
    print(f"\n{num_requests} requests in {elapsed:.1f} s: {counts}, preemptions {stats['num_preemptions']}{faults}")
    assert counts["cancelled"] > 0 and completed
    if injector is not None:
        assert injector.num_forward_failures > 0 and injector.num_detokenize_failures > 0
        assert counts["failed"] > 0
    reference = solo_outputs(tiny_model_dirs["llama"], {i: prompts[i] for i in completed}, max_tokens)
    mismatched = [i for i in completed if completed[i] != reference[i]]
    assert not mismatched, f"{len(mismatched)} completed outputs differ from their solo runs"
