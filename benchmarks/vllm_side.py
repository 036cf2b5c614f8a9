"""vLLM on the GPU benchmark's workloads, in a process of its own: the peer column of ``bench throughput --vllm``.

    PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python -m hearth_llm.benchmarks.vllm_side \\
        --shape llama3-8b --json vllm_llama3-8b.json

``throughput.py`` starts this module with ``--vllm`` (never importing vLLM itself). It imports only vLLM
and the two plain-Python modules both sides share, :mod:`.shapes` (the config) and :mod:`.workloads`
(the token ids), so the ids, lengths and options are the ones our side runs. One ``LLM(...)`` (about a
minute for the 8B shape: torch.compile and graph capture) runs every workload asked for. Weights are
vLLM's dummy ones (``load_format="dummy"``) of the same shape; prompts go in as token ids with no
tokenizer. The results (``measures``, keyed as our side keys them) are printed and written as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from . import workloads
from .shapes import SHAPES, config_json

WORKLOADS = ("throughput", "bs1", "burst", "long")


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The options both sides take, with the same defaults (``throughput.py`` adds these too)."""
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs=2, default=(100, 1024), metavar=("LOW", "HIGH"),
                        help="input and output lengths are uniform in [LOW, HIGH]")
    parser.add_argument("--prefix-burst", type=int, nargs=3, default=workloads.PREFIX_BURST,
                        metavar=("REQUESTS", "PREFIX", "OWN"), help="the shared-prefix burst's sizes")
    parser.add_argument("--long-context", type=int, nargs=3, default=workloads.LONG_CONTEXT,
                        metavar=("REQUESTS", "PROMPT", "NEW"), help="the long-context mix's sizes")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: 8704 (long prompt + new tokens) when the long-context mix runs, else 4096")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--json", required=True, help="write the results here")
    add_workload_options(parser)
    args = parser.parse_args(argv)
    if args.max_model_len is None:
        args.max_model_len = workloads.max_model_len_for(args.long_context if "long" in args.workloads else None)
    results = run(args)
    print(json.dumps(results), flush=True)
    with open(args.json, "w") as sink:
        json.dump(results, sink, indent=2)


def run(args) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    model_dir = tempfile.mkdtemp(prefix=f"vllm-{args.shape}-")
    with open(os.path.join(model_dir, "config.json"), "w") as sink:
        json.dump(config_json(args.shape, args.max_model_len), sink)
    options = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.max_model_len)
    started = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              enable_prefix_caching=True, gpu_memory_utilization=args.gpu_memory_utilization, **options)
    results = {"engine": f"vllm {vllm.__version__}", "shape": args.shape, "options": options,
               "init_s": time.perf_counter() - started, "kv_cache_tokens": _kv_cache_tokens(llm)}

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, int]:
        params = [SamplingParams(temperature=0, max_tokens=count, ignore_eos=True, detokenize=False)
                  for count in max_tokens]
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
        return time.perf_counter() - started, sum(len(output.outputs[0].token_ids) for output in outputs)

    results["measures"] = run_workloads(generate, args)
    return results


def run_workloads(generate, args) -> dict:
    """Every workload in ``args.workloads`` through ``generate(prompts, max_tokens) -> (seconds,
    output tokens)``, which times one batch from submission to its last token. Our side calls this
    too, with its own ``generate``: the order, the ids and the arithmetic are shared."""
    low, high = args.lengths
    for batch in workloads.warmup_batches(low, high):
        generate(batch, [4] * len(batch))
    measures: dict[str, float] = {}
    if "throughput" in args.workloads:
        requests = workloads.workload(args.num_seqs, low=low, high=high)
        seconds, num_output = generate([p for p, _ in requests], [m for _, m in requests])
        measures.update(throughput_tok_s=num_output / seconds, throughput_s=seconds,
                        throughput_output_tokens=num_output)
    if "bs1" in args.workloads:
        best = float("inf")
        for _ in range(workloads.BS1_REPEATS):
            first, _ = generate([workloads.BS1_PROMPT], [1])
            whole, _ = generate([workloads.BS1_PROMPT], [1 + workloads.BS1_NEW_TOKENS])
            best = min(best, (whole - first) / workloads.BS1_NEW_TOKENS)
        measures["bs1_ms_per_token"] = best * 1000
    if "burst" in args.workloads:
        burst = workloads.prefix_burst(*args.prefix_burst)
        measures["prefix_burst_cold_s"], _ = generate(burst["cold"], [1] * len(burst["cold"]))
        generate([burst["primer"]], [1])
        measures["prefix_burst_warm_s"], _ = generate(burst["warm"], [1] * len(burst["warm"]))
    if "long" in args.workloads:
        requests = workloads.long_context(*args.long_context)
        seconds, num_output = generate([p for p, _ in requests], [m for _, m in requests])
        measures.update(long_context_s=seconds, long_context_tok_s=num_output / seconds,
                        long_context_output_tokens=num_output)
    return measures


def _kv_cache_tokens(llm) -> int | None:
    """vLLM's KV cache in tokens, where this version tells (for the record beside ours)."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)
    except (AttributeError, TypeError):
        return None


if __name__ == "__main__":
    main()
