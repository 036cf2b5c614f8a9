"""Several models in one GPU process under one memory budget: their shares, all serving at once,
sleep and wake times, and the device memory each sleep returns (``torch.cuda.mem_get_info``).

    python -m hearth_llm.benchmarks.memory                       # Llama-3-8B + Qwen3-0.6B + bge-m3 shapes
    python -m hearth_llm.benchmarks.memory --big-layers 8        # a quicker, 8-layer "8B"
    python -m hearth_llm.benchmarks.memory --device cpu --big tiny-qwen3 --small tiny-qwen3 --no-embedder

Checkpoints are random weights of the real shapes, written as safetensors directories (level-2
wake reads them back from the page cache, as a local checkpoint would). One JSON line per
measurement, then PASS/FAIL lines for the goals (level-1 wake of the big model <= 2 s).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

WAKE_GOAL_S = 2.0


def write_checkpoint(shape: str, directory: Path, num_layers: int | None, device: str) -> Path:
    """Random weights of ``shape`` made on ``device`` (fast on a GPU), saved as safetensors shards."""
    from safetensors.torch import save_file

    from .random_weights import RandomWeights, checkpoint_shapes
    from .throughput import hf_config, placeholder_tokenizer

    config = hf_config(shape, num_layers)
    config.dtype = "bfloat16"
    weights = RandomWeights(checkpoint_shapes(config, torch.bfloat16), torch.bfloat16, device,
                            std=config.initializer_range)
    directory.mkdir(parents=True, exist_ok=True)
    shard, shard_bytes, index, weight_map = {}, 0, 0, {}
    names = list(weights)
    for position, name in enumerate(names):
        shard[name] = weights[name].cpu()
        shard_bytes += shard[name].numel() * 2
        if shard_bytes >= 2 << 30 or position == len(names) - 1:
            file = f"model-{index:05d}.safetensors"
            save_file(shard, str(directory / file))
            weight_map.update({key: file for key in shard})
            shard, shard_bytes, index = {}, 0, index + 1
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(directory)
    placeholder_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory


def emit(**row) -> dict:
    print(json.dumps(row), flush=True)
    return row


def free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]
    return 0


def timed_generate(llm, num_prompts: int, max_tokens: int) -> tuple[float, int]:
    from hearth_llm.engine import SamplingParams

    prompts = [[(7 * i + j) % 1000 + 3 for j in range(64)] for i in range(num_prompts)]
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outputs)


def sleep_and_wake(llm, name: str, level: int, device: str) -> dict:
    """Sleep, then wake by a request of one token: the sleep's time, the memory it returned,
    and the wake's time (wake_up alone) and the first token after it."""
    from hearth_llm.engine import SamplingParams

    before = free_bytes(device)
    started = time.perf_counter()
    llm.sleep(level=level)
    sleep_s = time.perf_counter() - started
    returned = free_bytes(device) - before
    started = time.perf_counter()
    llm.wake_up()
    wake_s = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first_token_s = time.perf_counter() - started
    return emit(model=name, level=level, sleep_s=round(sleep_s, 3), returned_gib=round(returned / 2**30, 2),
                wake_s=round(wake_s, 3), first_token_after_wake_s=round(first_token_s, 3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--big", default="llama3-8b")
    parser.add_argument("--big-layers", type=int, default=None)
    parser.add_argument("--small", default="qwen3-0.6b")
    parser.add_argument("--embedder", default="bge-m3")
    parser.add_argument("--no-embedder", action="store_true")
    parser.add_argument("--budget", default="0.9", help="fraction of the device, or bytes like '60GiB'")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args(argv)

    from hearth_llm.engine import LLM, memory_report, set_memory_budget

    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() and "." in args.budget else args.budget
    set_memory_budget(args.device, budget)
    root = Path(args.dir or tempfile.mkdtemp(prefix="hearth-memory-"))
    started = time.perf_counter()
    maker = "cuda" if args.device.startswith("cuda") else "cpu"
    big_dir = write_checkpoint(args.big, root / "big", args.big_layers, maker)
    small_dir = write_checkpoint(args.small, root / "small", None, maker)
    emit(step="checkpoints written", seconds=round(time.perf_counter() - started, 1))
    dtype = "bfloat16" if maker == "cuda" else "float32"

    started = time.perf_counter()
    big = LLM(str(big_dir), device=args.device, dtype=dtype, show_progress=False)
    emit(step="big loaded", seconds=round(time.perf_counter() - started, 1), **_share(big))
    started = time.perf_counter()
    small = LLM(str(small_dir), device=args.device, dtype=dtype, show_progress=False)
    emit(step="small loaded (the big one's free KV shrinks)", seconds=round(time.perf_counter() - started, 1),
         big=_share(big), small=_share(small))
    embedder = None
    if not args.no_embedder:
        from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine

        from .embeddings import write_passage_encoder

        started = time.perf_counter()
        # a random bge-m3-shaped XLM-R written here (its tokenizer too, where the bundled MiniLM is not installed)
        path = write_passage_encoder(str(root / "embedder"), args.embedder, maker)
        embedder = EmbeddingEngine(EmbeddingConfig(model=path, device=args.device, dtype=dtype))
        embedder.start()
        emit(step="embedder loaded", seconds=round(time.perf_counter() - started, 1))
    emit(step="budget", report=memory_report())

    failures = []
    results: dict[str, object] = {}

    def run(name, work):
        try:
            results[name] = work()
        except BaseException as error:  # noqa: BLE001 - reported below
            results[name] = error

    work = {"big": lambda: timed_generate(big, 32, 128), "small": lambda: timed_generate(small, 64, 128)}
    if embedder is not None:
        work["embedder"] = lambda: embedder.embed(["a passage about memory budgets " * 20] * 512).shape
    threads = [threading.Thread(target=run, args=(name, fn)) for name, fn in work.items()]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    emit(step="all serving at once", seconds=round(time.perf_counter() - started, 2),
         results={k: (repr(v) if isinstance(v, BaseException) else str(v)) for k, v in results.items()})
    failures += [f"{name} failed while the others served: {value!r}" for name, value in results.items()
                 if isinstance(value, BaseException)]

    level_1 = sleep_and_wake(big, args.big, 1, args.device)
    level_2 = sleep_and_wake(big, args.big, 2, args.device)
    sleep_and_wake(small, args.small, 1, args.device)
    if level_1["wake_s"] > WAKE_GOAL_S:
        failures.append(f"level-1 wake of {args.big} took {level_1['wake_s']} s > {WAKE_GOAL_S} s")
    if args.device.startswith("cuda") and level_1["returned_gib"] <= 0:
        failures.append("level-1 sleep returned no device memory")
    emit(step="level 2 wake reads the checkpoint", wake_s=level_2["wake_s"])
    for failure in failures:
        print("FAIL", failure)
    if not failures:
        print(f"PASS {len(work)} models served at once; level-1 wake {level_1['wake_s']} s (goal <= {WAKE_GOAL_S} s), "
              f"level-2 wake {level_2['wake_s']} s")
    for handle in (big, small):
        handle.close()
    if embedder is not None:
        embedder.close()
    return 1 if failures else 0


def _share(llm) -> dict:
    stats = llm.stats()
    return {"weights_gib": round(stats["weights_bytes"] / 2**30, 2), "kv_gib": round(stats["kv_cache_bytes"] / 2**30, 2),
            "kv_blocks": stats["num_total_blocks"]}


if __name__ == "__main__":
    raise SystemExit(main())
