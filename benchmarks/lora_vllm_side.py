"""vLLM's side of the multi-LoRA benchmark (benchmarks/lora.py): the same workload, shapes and adapter
files, in vLLM's own process (never imported by our engine). Self-contained: needs only vLLM, torch
and safetensors, no hearth_llm.

    PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/lora_vllm_side.py \\
        --adapters-dir /tmp/lora_adapters --time-budget-s 285 --json out.json

vLLM: ``enable_lora=True, max_loras=8, max_lora_rank=16``, dummy base weights (a directory with only
config.json), ``skip_tokenizer_init``. Adapters: random PEFT directories (A, B ~ N(0, 0.01) in bf16,
``lora_alpha = 2r``, q/k/v/o/gate/up/down), made here from fixed seeds exactly as
``benchmarks.lora.write_random_adapters`` makes them, or read from ``--adapters-dir`` if it holds them.
Runs, in this order: base-model requests on the LoRA engine, the workload spread over 8 adapters (request
``i`` on adapter ``i % 8``), batch-1 decode ms/token with one adapter and without, then 1 and 4 adapters.
The workload is ours by default (256 seqs, prompt and output lengths U[100, 1024]: benchmarks.lora's).
``--time-budget-s``: the seconds this process may take from its start; a run after the first two that would
not end within it (guessed from the runs before it, 1.3x the slowest plus its warm-up) is skipped and listed
in ``skipped``. The results file is rewritten after every run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=32, hidden_size=4096,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                 vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def workload(num_seqs: int, seed: int = 0, low: int = 100, high: int = 1024):
    """benchmarks.throughput.workload: the same prompts and output lengths for the same arguments."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_seqs):
        prompt = [rng.randint(0, 10000) for _ in range(rng.randint(low, high))]
        requests.append((prompt, rng.randint(low, high)))
    return requests


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """``model.layers.i.<block>.<proj>`` -> (out, in) for every LoRA target, as the HF checkpoint names them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
                 "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                 "mlp.down_proj": (hidden, inter)}
    return {f"model.layers.{i}.{name}": dims for i in range(config["num_hidden_layers"])
            for name, dims in per_layer.items()}


def write_random_adapters(config: dict, directory: Path, count: int, rank: int) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    # benchmarks.lora.write_random_adapters iterates the checkpoint's names in its order: layers in order,
    # within a layer as RandomWeights lists them; only the seeds and shapes matter for the benchmark.
    paths = []
    for index in range(count):
        path = directory / f"adapter{index}"
        if (path / "adapter_model.safetensors").exists():
            paths.append(path)
            continue
        generator = torch.Generator("cuda").manual_seed(index)
        tensors = {}
        for module, (out_features, in_features) in module_shapes(config).items():
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_features, generator=generator, device="cuda")
                                               * 0.01).bfloat16().cpu()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator, device="cuda")
                                               * 0.01).bfloat16().cpu()
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none",
             "use_rslora": False, "use_dora": False}))
        paths.append(path)
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters-dir", default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--no-base-only", action="store_true", help="skip the base-model requests on the LoRA engine")
    parser.add_argument("--bs1-repeats", type=int, default=2, help="batch-1 timings per case (the best is kept)")
    parser.add_argument("--no-base-bs1", action="store_true", help="time batch-1 decode with the adapter only")
    parser.add_argument("--adapter-counts", type=int, nargs="+", default=(8, 1, 4),
                        help="adapter runs after the base-only one, in this order (8 first: the issue's row)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="skip runs that would end later than this many seconds after the start")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    process_started = time.perf_counter()

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    results = {"engine": "vllm", "num_seqs": args.num_seqs, "lengths": list(args.lengths), "rank": args.rank}
    try:
        import vllm
        results["engine"] = f"vllm {vllm.__version__}"
    except AttributeError:
        pass
    model_dir = tempfile.mkdtemp()
    json.dump(dict(LLAMA3_8B, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1),
              open(os.path.join(model_dir, "config.json"), "w"))
    started = time.perf_counter()
    adapters_dir = Path(args.adapters_dir or tempfile.mkdtemp())
    paths = write_random_adapters(LLAMA3_8B, adapters_dir, 8, args.rank)
    results["adapter_write_s"] = round(time.perf_counter() - started, 1)
    # Keywords: newer vLLM moved lora_path before lora_int_id.
    loras = [LoRARequest(lora_name=f"adapter{i}", lora_int_id=i + 1, lora_path=str(path))
             for i, path in enumerate(paths)]

    started = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_num_seqs=args.num_seqs, max_num_batched_tokens=16384, max_model_len=4096,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
              enable_lora=True, max_loras=8, max_lora_rank=args.rank)
    results["init_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(results), flush=True)

    def params(max_tokens):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    def lora_requests(adapters: list, count: int):
        if all(adapter is None for adapter in adapters):
            return None  # base-model requests: no list of Nones
        return [adapters[i % len(adapters)] for i in range(count)]

    def run(adapters: list, shift: int) -> dict:
        for count in (1, 16, 17):  # warm-up as ours
            warm = workload(count, seed=count + shift, low=16, high=256)
            llm.generate([{"prompt_token_ids": p} for p, _ in warm], [params(4)] * count, use_tqdm=False,
                         lora_request=lora_requests(adapters, count))
        requests = workload(args.num_seqs, low=args.lengths[0], high=args.lengths[1])
        prompts = [{"prompt_token_ids": [(t + shift) % 10000 for t in p]} for p, _ in requests]
        started = time.perf_counter()
        outputs = llm.generate(prompts, [params(m) for _, m in requests], use_tqdm=False,
                               lora_request=lora_requests(adapters, len(requests)))
        elapsed = time.perf_counter() - started
        num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"seconds": round(elapsed, 3), "output_tokens": num_output, "tok_per_s": round(num_output / elapsed, 1)}

    results["skipped"] = []
    slowest = [0.0]

    def save() -> None:  # after every run: a process killed by its time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as sink:
                json.dump(results, sink, indent=2)

    def fits(name: str, estimate: float) -> bool:
        """Whether a run of about ``estimate`` seconds ends within the budget; records a skip if not."""
        if args.time_budget_s is None or time.perf_counter() - process_started + estimate <= args.time_budget_s:
            return True
        results["skipped"].append(name)
        print(json.dumps({"skipped": name, "elapsed_s": round(time.perf_counter() - process_started, 1)}), flush=True)
        return False

    def timed_run(name: str, adapters: list, shift: int, is_required: bool = False) -> None:
        if not is_required and not fits(name, 1.3 * slowest[0] + 5):
            return
        started_run = time.perf_counter()
        results[name] = run(adapters, shift)
        slowest[0] = max(slowest[0], time.perf_counter() - started_run)
        if name != "lora_engine_base_only" and "lora_engine_base_only" in results:
            results[name]["ratio_to_vllm_base_only"] = round(
                results[name]["tok_per_s"] / results["lora_engine_base_only"]["tok_per_s"], 3)
        print(json.dumps({name: results[name]}), flush=True)
        save()

    if not args.no_base_only:
        timed_run("lora_engine_base_only", [None], shift=1, is_required=True)
    counts = list(args.adapter_counts)
    shift_of = {count: 2 + index for index, count in enumerate(sorted(counts))}  # benchmarks.lora's, counts 1 4 8
    timed_run(f"adapters_{counts[0]}", loras[:counts[0]], shift=shift_of[counts[0]], is_required=True)
    bs1_cases = (("adapter_bs1_ms", loras[0]), ("base_bs1_ms", None))
    for name, lora in bs1_cases[:1] if args.no_base_bs1 else bs1_cases:
        if not fits(name, 4.0 * args.bs1_repeats):
            continue
        prompt = {"prompt_token_ids": list(range(100, 132))}
        best = 1e9
        for _ in range(args.bs1_repeats):  # (129 tokens - 1 token) / 128: the prefill and first token left out, as ours
            t0 = time.perf_counter()
            llm.generate([prompt], [params(1)], use_tqdm=False, lora_request=lora)
            t1 = time.perf_counter()
            llm.generate([prompt], [params(129)], use_tqdm=False, lora_request=lora)
            best = min(best, (time.perf_counter() - t1 - (t1 - t0)) / 128)
        results[name] = round(best * 1000, 3)
        print(json.dumps({name: results[name]}), flush=True)
        save()
    for count in counts[1:]:
        timed_run(f"adapters_{count}", loras[:count], shift=shift_of[count])
    results["seconds_since_init_started"] = round(time.perf_counter() - started, 1)
    results["seconds_in_all"] = round(time.perf_counter() - process_started, 1)
    print(json.dumps(results, indent=2), flush=True)
    save()


if __name__ == "__main__":
    main()
