"""vLLM with ``quantization="fp8"`` (dynamic per-token activation scales, per-channel weight scales
made at load from its dummy bf16 weights) on the workloads of ``quant_engine.py``, in a process of
its own: the peer column of the FP8 rows.

    PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python -m hearth_llm.benchmarks.quant_vllm_side \\
        --shape llama3-8b --workloads bs1 throughput --json vllm_fp8.json

Like :mod:`.vllm_side` it imports only vLLM and our plain-Python modules (:mod:`.shapes`,
:mod:`.workloads`, :func:`.vllm_side.run_workloads`), so the ids, warm-up and arithmetic are the
ones our side runs.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from .shapes import SHAPES, config_json
from .vllm_side import add_workload_options, run_workloads


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--workloads", nargs="+", choices=("throughput", "bs1"), default=["bs1", "throughput"])
    parser.add_argument("--quantization", default="fp8", help="vLLM's quantization= (None: bf16)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--json", required=True)
    add_workload_options(parser)
    args = parser.parse_args(argv)
    args.max_model_len = args.max_model_len or 4096

    import vllm
    from vllm import LLM, SamplingParams

    model_dir = tempfile.mkdtemp(prefix=f"vllm-{args.shape}-")
    with open(os.path.join(model_dir, "config.json"), "w") as sink:
        json.dump(config_json(args.shape, args.max_model_len), sink)
    options = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.max_model_len)
    quantization = None if args.quantization in ("", "none", "None") else args.quantization
    started = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              enable_prefix_caching=True, gpu_memory_utilization=args.gpu_memory_utilization,
              quantization=quantization, **options)
    results = {"engine": f"vllm {vllm.__version__}", "shape": args.shape, "quantization": quantization,
               "options": options, "init_s": time.perf_counter() - started}
    print(f"vLLM {quantization} up in {results['init_s']:.1f} s", flush=True)

    def generate(prompts, max_tokens):
        params = [SamplingParams(temperature=0, max_tokens=count, ignore_eos=True, detokenize=False)
                  for count in max_tokens]
        begun = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
        return time.perf_counter() - begun, sum(len(output.outputs[0].token_ids) for output in outputs)

    # bs1 first: it is short, and a kill at the time limit still leaves it printed.
    results["measures"] = {}
    for name in sorted(args.workloads, key=lambda w: w != "bs1"):
        sub = argparse.Namespace(**{**vars(args), "workloads": [name]})
        results["measures"].update(run_workloads(generate, sub))
        print(f"vLLM {quantization} {name}: {json.dumps(results['measures'])}", flush=True)
    with open(args.json, "w") as sink:
        json.dump(results, sink, indent=2)


if __name__ == "__main__":
    main()
