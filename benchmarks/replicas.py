"""Engine replicas on Ray against one engine in this process, on this machine's CPU.

    python -m hearth_llm.benchmarks.replicas [--model default|tiny|PATH] [--tokens 128] [--requests 32]

1. per-token streaming overhead: one greedy stream of ``--tokens`` tokens, its inter-token time
   in-process (``AsyncLLM(model)``) and through one Ray replica (``replicas=1, backend="ray"``), both
   on one torch thread so only the path differs; the difference is what a token costs to cross Ray
   (the replica's outbox, one ``poll`` reply, the driver's pump, the caller's stream). The same for
   a whole one-token request (routing, tokenizing in the driver, the add call, prefill, the end).
2. throughput: ``--requests`` requests of ``--tokens`` tokens sent at once, to one in-process engine
   on every core and to one replica per core (``ray.init(address="local")``).

Runs are interleaved (A, B, A, B) and the best of ``--repeats`` is kept: the machine is shared.
``--model tiny`` is a random 2-layer Llama (steps of ~1 ms: overhead dominates); ``default`` is the
bundled SmolLM2-135M. The table ends with the CPU count and load average.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

TINY_VOCAB = 320


def tiny_model_dir(root: Path) -> str:
    """A random 2-layer Llama with a word-level tokenizer (the tests' tiny model, written here)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root)
    backend = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(TINY_VOCAB)}, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w1", eos_token="w2", pad_token="w0",
                            unk_token="w3").save_pretrained(root)
    return str(root)


def prompts_for(model: str, count: int) -> list:
    if model == "default":
        return [f"Question {i}: name a city in Europe and one thing it is known for." for i in range(count)]
    return [[4 + (i * 7 + j) % (TINY_VOCAB - 4) for j in range(16)] for i in range(count)]


async def inter_token_ms(engine, prompt, tokens: int) -> float:
    """Mean ms per token of one greedy stream from its first output to its last: outputs that
    cross Ray may arrive several at once, so gaps between single outputs would say nothing."""
    from hearth_llm.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    first = last = None
    num_tokens = 0
    async for out in engine.generate(prompt, params):
        last = time.perf_counter()
        if first is None:
            first = last
        else:
            num_tokens += len(out.delta_token_ids)
    return (last - first) * 1e3 / max(1, num_tokens)


async def request_ms(engine, prompt, count: int = 5) -> float:
    """Median ms of a whole one-token request (prefill, one token, the stream's end): the per-request cost."""
    from hearth_llm.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        async for _ in engine.generate(prompt, params):
            pass
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


async def throughput(engine, prompts, tokens: int) -> float:
    """Output tok/s of all ``prompts`` sent at once."""
    from hearth_llm.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    async def one(prompt) -> int:
        return sum([len(out.delta_token_ids) async for out in engine.generate(prompt, params)])

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(prompt) for prompt in prompts))
    return sum(counts) / (time.perf_counter() - started)


async def best_of(repeats: int, measure, better=min) -> float:
    results = [await measure() for _ in range(repeats)]
    return better(results)


async def run(args) -> list[tuple[str, str]]:
    import ray

    from hearth_llm.engine import AsyncLLM

    common = dict(show_progress=False, device="cpu", max_num_seqs=max(8, args.requests), kv_cache_memory="256MiB")
    cores = len(os.sched_getaffinity(0))
    # one logical CPU more than the cores: the 1-replica set and the N-replica set both stay up (one runs at a time)
    ray.init(address="local", num_cpus=cores + 1, include_dashboard=False, log_to_driver=False)
    prompt = prompts_for(args.model, 1)[0]
    prompts = prompts_for(args.model, args.requests)
    engines = {
        "local, 1 thread": AsyncLLM(args.model, num_threads=1, **common),
        "ray, 1 replica x 1 thread": AsyncLLM(args.model, num_threads=1, replicas=1, backend="ray", **common),
        "local, all cores": AsyncLLM(args.model, **common),
        f"ray, {cores} replicas x 1 core": AsyncLLM(args.model, replicas=cores, backend="ray", **common),
    }
    for engine in engines.values():  # load and warm every engine before any timing
        await asyncio.to_thread(engine.core.wait_until_started)
        await inter_token_ms(engine, prompt, 8)
    rows = []
    latency = {name: [] for name in list(engines)[:2]}
    per_request = {name: [] for name in list(engines)[:2]}
    rates = {name: [] for name in list(engines)[2:]}
    for _ in range(args.repeats):
        for name in latency:
            latency[name].append(await inter_token_ms(engines[name], prompt, args.tokens))
            per_request[name].append(await request_ms(engines[name], prompt))
        for name in rates:
            rates[name].append(await throughput(engines[name], prompts, args.tokens))
    local_ms, ray_ms = (min(values) for values in latency.values())
    for name, values in latency.items():
        rows.append((f"single stream, {name}: ms/token (mean after the first, best of {args.repeats})", f"{min(values):.3f}"))
    rows.append(("per-token overhead through Ray (ms)", f"{ray_ms - local_ms:+.3f} ({(ray_ms / local_ms - 1) * 100:+.1f} %)"))
    for name, values in per_request.items():
        rows.append((f"one-token request, {name}: ms (median of 5, best of {args.repeats})", f"{min(values):.2f}"))
    local_request, ray_request = (min(values) for values in per_request.values())
    rows.append(("per-request overhead through Ray (ms)", f"{ray_request - local_request:+.2f}"))
    for name, values in rates.items():
        rows.append((f"{args.requests} requests x {args.tokens} tokens, {name}: tok/s (best)", f"{max(values):.1f}"))
    local_rate, ray_rate = (max(values) for values in rates.values())
    rows.append((f"{cores} replicas / 1 engine", f"{ray_rate / local_rate:.2f}x"))
    for engine in engines.values():
        engine.close()
    ray.shutdown()
    rows.append(("machine", f"{cores} cores, load average {os.getloadavg()[0]:.1f}"))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random 2-layer Llama), 'default', or a path")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        if args.model == "tiny":
            args.model = tiny_model_dir(Path(root))
        rows = asyncio.run(run(args))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
