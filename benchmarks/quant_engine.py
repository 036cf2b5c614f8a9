"""Our engine on a random-weight shape, dense or quantized: bs1 decode and the throughput workload.

``--method`` picks the linear layers: ``bf16`` (dense), ``fp8`` (``LLM(quantization="fp8")``:
the bf16 checkpoint quantized at load) or ``awq`` (a checkpoint whose decoder linears are AWQ
GEMM parts — random codes, zero points 8, scales 0.002 — repacked into ``W4G128`` as they load:
the w4a16 path). The workloads and their arithmetic are :func:`.vllm_side.run_workloads`'s, so the
numbers sit beside ``quant_vllm_side.py``'s for vLLM; ``ours_bs1_ms_per_token`` (steady decode of
128 tokens, the figure earlier notes quote) is printed too.

    python -m hearth_llm.benchmarks.quant_engine --shape llama3-8b --method fp8 --workloads bs1 throughput
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from .throughput import (decode_graph_bs1_ms, engine_generate, hf_config, ours_bs1_ms_per_token,
                         placeholder_tokenizer, random_checkpoint)
from .vllm_side import add_workload_options, run_workloads

METHODS = ("bf16", "fp8", "awq")


def awq_checkpoint(shape: str, device: str, num_layers: int | None = None, max_model_len: int | None = None):
    """A checkpoint of ``shape`` whose decoder ``*_proj`` linears are AWQ GEMM parts (see the module
    docstring), everything else random bf16, each tensor made on ``device`` when the loader reads it."""
    from hearth_llm.engine.loader.checkpoint import LoadedCheckpoint

    from .random_weights import RandomWeights, checkpoint_shapes

    config = hf_config(shape, num_layers, max_model_len)
    config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                  "version": "gemm"}
    dense_shapes = checkpoint_shapes(config, torch.bfloat16)
    linears = sorted(name for name in dense_shapes if name.endswith("_proj.weight") and ".layers." in name)
    dense = RandomWeights({name: dims for name, dims in dense_shapes.items() if name not in linears},
                          torch.bfloat16, device, std=config.initializer_range)
    shapes = {name: (dims, shape) for name, dims in dense.shapes.items()}
    for name in linears:
        n, k = dense_shapes[name]
        prefix = name[:-len(".weight")]
        shapes |= {prefix + ".qweight": ((k, n // 8), shape), prefix + ".qzeros": ((k // 128, n // 8), shape),
                   prefix + ".scales": ((k // 128, n), shape)}

    def stream():
        yield from dense.items()
        generator = torch.Generator(device).manual_seed(0)
        for name in linears:
            n, k = dense_shapes[name]
            prefix = name[:-len(".weight")]
            yield prefix + ".qweight", torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32,
                                                     device=device, generator=generator)
            yield prefix + ".qzeros", torch.full((k // 128, n // 8), 0x88888888 - 2**32, dtype=torch.int32,
                                                 device=device)
            yield prefix + ".scales", torch.full((k // 128, n), 0.002, dtype=torch.float16, device=device)

    return LoadedCheckpoint(config, placeholder_tokenizer(config.vocab_size), shape, weight_stream=stream,
                            weight_shapes=shapes, dtype=torch.bfloat16)


def build_engine(args):
    from hearth_llm.engine.config import EngineConfig
    from hearth_llm.engine.llm_engine import LLMEngine

    if args.method == "awq":
        checkpoint = awq_checkpoint(args.shape, args.device, args.num_layers, args.max_model_len)
    else:
        _, checkpoint = random_checkpoint(args.shape, torch.bfloat16, args.device, args.num_layers, args.max_model_len)
    config = EngineConfig(model=checkpoint.source, dtype="bfloat16", device=args.device,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, show_progress=False,
                          quantization="fp8" if args.method == "fp8" else None)
    return LLMEngine(config, checkpoint=checkpoint)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--workloads", nargs="+", choices=("throughput", "bs1"), default=["bs1"])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer decoder layers (smoke tests)")
    parser.add_argument("--kv-cache-memory", default="40GiB")
    parser.add_argument("--json", help="also write the results here")
    add_workload_options(parser)
    args = parser.parse_args(argv)
    args.max_model_len = args.max_model_len or 4096
    started = time.perf_counter()
    engine = build_engine(args)
    model = engine.runner.model
    results = {"shape": args.shape, "method": args.method, "init_s": time.perf_counter() - started,
               "weight_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values())}
    print(f"{args.method} {args.shape}: engine up in {results['init_s']:.1f} s, "
          f"weights {results['weight_bytes'] / 2**30:.2f} GiB", flush=True)
    generate = engine_generate(engine)
    results["measures"] = {}
    for name in sorted(args.workloads, key=lambda w: w != "bs1"):  # bs1 first: short, printed before a kill
        results["measures"].update(run_workloads(generate, argparse.Namespace(**{**vars(args), "workloads": [name]})))
        print(f"{args.method} {args.shape} {name}: {json.dumps(results['measures'])}", flush=True)
    results["ours_bs1_ms_per_token"] = ours_bs1_ms_per_token(engine, num_tokens=128 if args.device == "cuda" else 8)
    if args.device == "cuda":
        results["bs1_decode_graph_ms"] = decode_graph_bs1_ms(engine)
    print(f"{args.method} {args.shape} ours_bs1_ms_per_token {results['ours_bs1_ms_per_token']:.3f}"
          f" decode graph {results.get('bs1_decode_graph_ms')}", flush=True)
    if args.json:
        with open(args.json, "w") as sink:
            json.dump(results, sink, indent=2)


if __name__ == "__main__":
    main()
