"""Multi-LoRA throughput on the GPU: the benchmark workload spread over 1, 4 and 8 random rank-16
adapters (q/k/v/o/gate/up/down, written as PEFT directories), against the same base without LoRA.

    python -m hearth_llm.benchmarks.lora --shape llama3-8b                  # the issue's benchmark
    python -m hearth_llm.benchmarks.lora --shape tiny-qwen3 --device cpu --num-seqs 8 --lengths 8 16   # dry run

Reports output tok/s per run and its ratio to the base engine, and batch-1 decode ms/token with
and without an adapter (best of ``--bs1-repeats``). Each run shifts the prompts' token ids, so no run
reuses another's prefix cache. Order: the base engine (throughput, bs1), then on the LoRA engine the
adapter counts as given (8 first by default), bs1 with an adapter after the first, the base-only run
last (first where it is the ratios' denominator: ``--no-base-engine``/``--base-bs1-only``);
``--time-budget-s`` skips later runs that would not fit.
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from .random_weights import checkpoint_shapes
from .throughput import SHAPES, hf_config, random_checkpoint, synchronize, workload

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapters(shapes: dict[str, tuple[int, ...]], directory: Path, count: int, rank: int,
                          device: str) -> list[Path]:
    """``count`` PEFT LoRA directories with random A and B (std 0.01) on every target module."""
    modules = {name.removesuffix(".weight"): dims for name, dims in shapes.items()
               if name.endswith(".weight") and name.split(".")[-2] in TARGETS}
    paths = []
    for index in range(count):
        generator = torch.Generator(device).manual_seed(index)
        tensors = {}
        for module, (out_features, in_features) in modules.items():
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_features, generator=generator, device=device)
                                               * 0.01).bfloat16().cpu()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator, device=device)
                                               * 0.01).bfloat16().cpu()
        path = directory / f"adapter{index}"
        path.mkdir(exist_ok=True)
        save_file(tensors, path / "adapter_model.safetensors")
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                  "bias": "none", "use_rslora": False, "use_dora": False}
        (path / "adapter_config.json").write_text(json.dumps(config))
        paths.append(path)
    return paths


def make_engine(shape: str, device: str, enable_lora: bool, max_num_seqs: int, kv_cache_memory: str,
                num_layers: int | None = None):
    from hearth_llm.engine.config import EngineConfig
    from hearth_llm.engine.llm_engine import LLMEngine

    weights, checkpoint = random_checkpoint(shape, torch.bfloat16, device, num_layers=num_layers)
    config = EngineConfig(model=shape, dtype="bfloat16", device=device, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=16384, kv_cache_memory=kv_cache_memory, max_model_len=4096,
                          show_progress=False, enable_lora=enable_lora, max_loras=8, max_lora_rank=16)
    return LLMEngine(config, checkpoint=checkpoint), weights.shapes


def run(engine, requests, loras: list, shift: int, profile: str | None = None) -> dict:
    """Our engine on the workload, request ``i`` with ``loras[i % len(loras)]``; tokens shifted by ``shift``.
    ``profile``: a file for torch.profiler tables of 20 steps from the 100th on (those run a little slower;
    making the tables, ~1 s, is left out of the time). ``graphed_steps``: steps that replayed a CUDA graph."""
    from hearth_llm.engine.sampling_params import SamplingParams

    def params(max_tokens):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    for count in (1, 16, 17):  # warm-up: every kernel specialization the workload meets
        for index, (prompt, _) in enumerate(workload(count, seed=count + shift, low=16, high=256)):
            engine.add_request(prompt, params(4), lora_request=loras[index % len(loras)])
        while engine.has_unfinished_requests():
            engine.step()
    synchronize(engine.runner.device)
    started = time.perf_counter()
    for index, (prompt, max_tokens) in enumerate(requests):
        engine.add_request([(t + shift) % 10000 for t in prompt], params(max_tokens),
                           lora_request=loras[index % len(loras)])
    num_output, num_steps, profiler, first_steps_seconds, not_timed = 0, 0, None, 0.0, 0.0
    preemptions_before = engine.scheduler.num_preemptions
    graphs = engine.runner.decode_graphs
    replays_before = getattr(graphs, "num_replays", 0)
    while engine.has_unfinished_requests():
        if profile and num_steps == 100:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        num_output += sum(len(d.new_token_ids) for d in engine.step())
        num_steps += 1
        if num_steps == 3:  # the prompts (64 x U[100,512] at 16384 tokens a step) are in by now: mostly prefill
            synchronize(engine.runner.device)
            first_steps_seconds = time.perf_counter() - started
        if profiler is not None and num_steps == 120:
            synchronize(engine.runner.device)
            paused = time.perf_counter()
            profiler.__exit__(None, None, None)
            with open(profile, "w") as sink:
                sink.write(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=25))
                sink.write("\n\n" + profiler.key_averages().table(sort_by="cpu_time_total", row_limit=25))
            profiler = None
            not_timed = time.perf_counter() - paused
    synchronize(engine.runner.device)
    elapsed = time.perf_counter() - started - not_timed
    for request_id in list(engine.groups):
        engine.release(request_id)
    return {"seconds": round(elapsed, 3), "output_tokens": num_output, "tok_per_s": round(num_output / elapsed, 1),
            "first_3_steps_seconds": round(first_steps_seconds, 3) if num_steps >= 3 else None, "steps": num_steps,
            "graphed_steps": getattr(graphs, "num_replays", 0) - replays_before,
            "preemptions": engine.scheduler.num_preemptions - preemptions_before}


def bs1_ms_per_token(engine, lora, repeats: int = 1, num_tokens: int = 128, tokens: list | None = None) -> float:
    """Batch-1 decode ms/token (the prefill and first token left out), the best of ``repeats`` requests.
    ``tokens``: a list that gets the generated token ids of the first request."""
    return min(_bs1_once(engine, lora, num_tokens, tokens if index == 0 else None) for index in range(repeats))


def _bs1_once(engine, lora, num_tokens: int, tokens: list | None = None) -> float:
    from hearth_llm.engine.sampling_params import SamplingParams

    engine.add_request(list(range(100, 132)), SamplingParams(temperature=0, max_tokens=num_tokens + 1, ignore_eos=True,
                                                             detokenize=False), lora_request=lora)
    generated = [t for d in engine.step() for t in d.new_token_ids]  # prefill + first token: not timed
    synchronize(engine.runner.device)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        generated += [t for d in engine.step() for t in d.new_token_ids]
    synchronize(engine.runner.device)
    seconds = time.perf_counter() - started
    for request_id in list(engine.groups):
        engine.release(request_id)
    if tokens is not None:
        tokens.extend(generated)
    return round(seconds * 1000 / num_tokens, 3)


def bs1_only(args, shapes: dict, results: dict, save) -> None:
    """``--bs1-only``: batch-1 decode ms/token, the engine without LoRA, then LoRA engines serving base and
    one adapter: as set, or with ``--pdl-ab`` one per variant (graphs capture the setting): ``plain``
    (the expands without PDL), ``pdl`` (with); ``--profile``: the first variant's kernels. Reports the
    adapter's extra µs per decoder layer, and whether the variants'
    greedy tokens equal the first's (PDL must not change them)."""
    from hearth_llm.engine.lora import LoRARequest
    from hearth_llm.kernels.lora import triton_lora

    num_layers = hf_config(args.shape, args.num_layers).num_hidden_layers
    results["num_layers"] = num_layers
    if not args.no_base_engine:
        engine, shapes = make_engine(args.shape, args.device, False, 1, args.kv_cache_memory, args.num_layers)
        results["base_bs1_ms"] = bs1_ms_per_token(engine, None, args.bs1_repeats)
        print(json.dumps({"base_bs1_ms": results["base_bs1_ms"]}), flush=True)
        save()
        del engine
        _free(args.device)
    with tempfile.TemporaryDirectory() as directory:
        directory = args.adapters_dir or directory
        Path(directory).mkdir(parents=True, exist_ok=True)
        [path] = write_random_adapters(shapes, Path(directory), 1, args.rank, args.device)
        lora = LoRARequest("adapter0", str(path))
        tokens_of = {}
        variants = (("plain", False), ("pdl", True)) if args.pdl_ab else (("lora", triton_lora.USE_PDL),)
        for key, pdl in variants:
            triton_lora.USE_PDL = pdl
            engine, _ = make_engine(args.shape, args.device, True, 1, args.kv_cache_memory, args.num_layers)
            base_ms = bs1_ms_per_token(engine, None, args.bs1_repeats)
            tokens_of[key] = []
            adapter_ms = bs1_ms_per_token(engine, lora, args.bs1_repeats, tokens=tokens_of[key])
            denominator = results.get("base_bs1_ms", base_ms)
            results[key] = {"base_bs1_ms_on_lora_engine": base_ms, "adapter_bs1_ms": adapter_ms,
                            "bs1_ratio": round(adapter_ms / denominator, 3),
                            "adapter_us_per_layer": round((adapter_ms - denominator) * 1000 / num_layers, 2)}
            print(json.dumps({key: results[key]}), flush=True)
            save()
            if args.profile and key == variants[0][0]:  # the kernels of 16 decode steps, with and without the adapter
                for name, request in (("adapter", lora), ("base", None)):
                    _profiled_bs1(engine, request, f"{args.profile}.{key}.{name}")
            del engine
            _free(args.device)
        first = next(iter(tokens_of.values()))
        for key, tokens in list(tokens_of.items())[1:]:
            same = [a == b for a, b in zip(first, tokens)] + [False]
            results[f"{key}_tokens_equal"] = tokens == first
            results[f"{key}_first_token_apart"] = None if tokens == first else same.index(False)
            print(json.dumps({f"{key}_tokens_equal": tokens == first, "apart_at": results[f"{key}_first_token_apart"],
                              "num_tokens": len(tokens)}), flush=True)


def _profiled_bs1(engine, lora, path: str, num_tokens: int = 16) -> None:
    """A torch.profiler table (by CUDA time, with call counts) of a batch-1 request's decode steps."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        _bs1_once(engine, lora, num_tokens)
    with open(path, "w") as sink:
        sink.write(f"{num_tokens} decode steps (+ the prefill step)\n")
        sink.write(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    from hearth_llm.engine.lora import LoRARequest

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs=2, default=(100, 1024), metavar=("LOW", "HIGH"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="40GiB")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--adapter-counts", type=int, nargs="+", default=(8, 1, 4),
                        help="adapters per run, in this order (the first, the issue's 8, is never skipped)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="skip adapter runs after the first that would end later than this many seconds after "
                             "the start (guessed as 1.3x the slowest run so far); they are listed in 'skipped'")
    parser.add_argument("--bs1-repeats", type=int, default=2, help="batch-1 requests timed per case (the best is kept)")
    parser.add_argument("--no-base-only", action="store_true", help="skip the LoRA engine serving base requests")
    parser.add_argument("--profile", help="a file for a torch.profiler table of 20 steps of the first adapter run "
                                          "(and FILE.base_only: of the LoRA engine's base-only run)")
    parser.add_argument("--no-overlap", action="store_true", help="run the LoRA shrink on the main stream (the default)")
    parser.add_argument("--overlap", action="store_true",
                        help="run the LoRA shrink on a side stream beside the base projection (not GPU-verified yet)")
    parser.add_argument("--no-stack", action="store_true",
                        help="a separate shrink kernel, not every slot's A stacked under the dense base weight")
    parser.add_argument("--unstacked", nargs="+", default=(), metavar="NAME_END",
                        help="layers (by name end: o_proj, down_proj, ...) that keep the separate shrink kernel")
    parser.add_argument("--no-pdl", action="store_true",
                        help="plain launches of the LoRA expands, not programmatic dependent launch "
                             "(kernels.lora.triton_lora.USE_PDL, on by default)")
    parser.add_argument("--no-fused-swiglu", action="store_true",
                        help="gate_up_proj expands in place (the SwiGLU does not add its update)")
    parser.add_argument("--adapters-dir", help="write the adapters here and keep them (for a peer to load)")
    parser.add_argument("--num-layers", type=int, help="fewer decoder layers than the shape's (a quick look)")
    parser.add_argument("--no-base-engine", action="store_true",
                        help="no engine without LoRA: ratios are to the LoRA engine serving base requests")
    parser.add_argument("--base-bs1-only", action="store_true",
                        help="the engine without LoRA times batch-1 decode only (throughput ratios as --no-base-engine)")
    parser.add_argument("--bs1-only", action="store_true",
                        help="only batch-1 decode: without LoRA, then with one adapter (and the base on the LoRA engine)")
    parser.add_argument("--pdl-ab", action="store_true",
                        help="with --bs1-only: a LoRA engine with plain expand launches, then one with PDL")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    process_started = time.perf_counter()
    if args.no_overlap or args.overlap:
        from hearth_llm.engine.models.lora_linear import LoRAStep

        LoRAStep.overlaps_shrink = args.overlap and not args.no_overlap
    from hearth_llm.engine.models.lora_linear import LoRAStep

    LoRAStep.stacks_shrink = not args.no_stack
    LoRAStep.unstacked_layers = tuple(args.unstacked)
    LoRAStep.defers_gate_up_expand = not args.no_fused_swiglu
    if args.no_pdl:
        from hearth_llm.kernels.lora import triton_lora

        triton_lora.USE_PDL = False
    requests = workload(args.num_seqs, low=args.lengths[0], high=args.lengths[1])
    results = {"shape": args.shape, "num_seqs": args.num_seqs, "lengths": list(args.lengths), "rank": args.rank}

    shapes = checkpoint_shapes(hf_config(args.shape, args.num_layers), torch.bfloat16)  # (names and dims only)
    if args.bs1_only:
        def save_bs1() -> None:
            if args.json:
                with open(args.json, "w") as sink:
                    json.dump(results, sink, indent=2)

        bs1_only(args, shapes, results, save_bs1)
        results["seconds_in_all"] = round(time.perf_counter() - process_started, 1)
        print(json.dumps(results, indent=2))
        save_bs1()
        return
    if not args.no_base_engine:
        engine, shapes = make_engine(args.shape, args.device, False, args.num_seqs, args.kv_cache_memory,
                                     args.num_layers)
        if not args.base_bs1_only:
            results["base"] = run(engine, requests, [None], shift=0)
        base_bs1_tokens = []
        results["base_bs1_ms"] = bs1_ms_per_token(engine, None, args.bs1_repeats, tokens=base_bs1_tokens)
        print(json.dumps(results), flush=True)
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory() as directory:
        if args.adapters_dir:
            directory = args.adapters_dir
            Path(directory).mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        paths = write_random_adapters(shapes, Path(directory), max(args.adapter_counts), args.rank, args.device)
        results["adapter_write_seconds"] = round(time.perf_counter() - started, 2)
        started = time.perf_counter()
        engine, _ = make_engine(args.shape, args.device, True, args.num_seqs, args.kv_cache_memory, args.num_layers)
        results["lora_engine_seconds"] = round(time.perf_counter() - started, 1)
        loras = [LoRARequest(f"adapter{i}", str(path)) for i, path in enumerate(paths)]
        results["skipped"] = []
        slowest = [0.0]

        def save() -> None:  # after every run: a process killed by its time limit keeps what it measured
            if args.json:
                with open(args.json, "w") as sink:
                    json.dump(results, sink, indent=2)

        def fits(name: str, estimate: float) -> bool:
            if args.time_budget_s is None or time.perf_counter() - process_started + estimate <= args.time_budget_s:
                return True
            results["skipped"].append(name)
            print(json.dumps({"skipped": name, "elapsed_s": round(time.perf_counter() - process_started, 1)}),
                  flush=True)
            return False

        def timed_run(name: str, adapters: list, shift: int, profile: str | None, is_required: bool) -> None:
            if not is_required and not fits(name, 1.3 * slowest[0] + 3):
                return
            started_run = time.perf_counter()
            results[name] = run(engine, requests, adapters, shift=shift, profile=profile)
            slowest[0] = max(slowest[0], time.perf_counter() - started_run)
            denominator = results.get("base", results.get("lora_engine_base_only"))
            if denominator is not results[name]:
                results[name]["ratio_to_base"] = round(results[name]["tok_per_s"] / denominator["tok_per_s"], 3)
            print(json.dumps({name: results[name]}), flush=True)
            save()

        base_only_profile = args.profile and f"{args.profile}.base_only"
        if "base" not in results:  # the ratios' denominator: first
            timed_run("lora_engine_base_only", [None], 1, base_only_profile, is_required=True)
        shift_of = {count: 2 + index for index, count in enumerate(sorted(args.adapter_counts))}  # as the vLLM side's
        for index, count in enumerate(args.adapter_counts):
            timed_run(f"adapters_{count}", loras[:count], shift_of[count], args.profile if index == 0 else None,
                      is_required=index == 0)
            if index == 0:  # batch-1 decode with an adapter right after the first (the issue's) run
                # Base requests at batch 1 on the LoRA engine: the base engine's kernels (the same random weights),
                # so the same greedy tokens.
                lora_engine_base_tokens = []
                results["base_bs1_ms_on_lora_engine"] = bs1_ms_per_token(engine, None, args.bs1_repeats,
                                                                         tokens=lora_engine_base_tokens)
                if "base_bs1_ms" in results:
                    results["lora_engine_base_bs1_tokens_equal"] = lora_engine_base_tokens == base_bs1_tokens
                results["adapter_bs1_ms"] = bs1_ms_per_token(engine, loras[0], args.bs1_repeats)
                results["bs1_ratio"] = round(results["adapter_bs1_ms"] / results.get(
                    "base_bs1_ms", results.get("base_bs1_ms_on_lora_engine")), 3)
                print(json.dumps({key: results.get(key) for key in (
                    "adapter_bs1_ms", "bs1_ratio", "base_bs1_ms_on_lora_engine", "lora_engine_base_bs1_tokens_equal")}),
                    flush=True)
                save()
        if "lora_engine_base_only" not in results and not args.no_base_only:
            timed_run("lora_engine_base_only", [None], 1, base_only_profile, is_required=False)
        results["num_slot_loads"] = engine.lora_manager.num_slot_loads
    results["seconds_in_all"] = round(time.perf_counter() - process_started, 1)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as sink:
            json.dump(results, sink, indent=2)


if __name__ == "__main__":
    main()
