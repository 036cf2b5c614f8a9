"""Our engine on a random-weight shape, dense or quantized: bs1 decode and the throughput workload.

``--method`` picks the linear layers: ``bf16`` (dense), ``fp8`` (``LLM(quantization="fp8")``:
the bf16 checkpoint quantized at load) or ``awq`` (a checkpoint whose decoder linears are AWQ
GEMM parts — random codes, zero points 8, scales 0.002 — repacked into ``W4G128`` as they load:
the w4a16 path). The workloads and their arithmetic are :func:`.vllm_side.run_workloads`'s, so the
numbers sit beside ``quant_vllm_side.py``'s for vLLM; ``ours_bs1_ms_per_token`` (steady decode of
128 tokens, the figure earlier notes quote) is printed too.

    python -m hearth_llm.benchmarks.quant_engine --shape llama3-8b --method fp8 --workloads bs1 throughput
    python -m hearth_llm.benchmarks.quant_engine --method fp8 --workloads bs1 throughput --then-fp8-kv
    python -m hearth_llm.benchmarks.quant_engine --method fp8 --quality --num-layers 4   # kernel checks + guard
"""
from __future__ import annotations

import argparse
import gc
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
                          quantization="fp8" if args.method == "fp8" else None, kv_cache_dtype=args.kv_cache_dtype)
    return LLMEngine(config, checkpoint=checkpoint)


# bs1 A/B variants: the one-row GEMV on or off (off: the several-row dot_gemv takes one-row steps).
# H200 round 1 also timed RMSNorm / SwiGLU fused into the one-row GEMV (triton_fp8.RMS_NORM /
# SILU_AND_MUL prologues, fused_decode wrapped in-process): 3.49 ms/token against 3.36 unfused,
# so the engine does not use them (commit cb0d96d has the wrapper).
BS1_VARIANTS = {"row": True, "dot (old)": False}


def greedy_tokens(engine, num_tokens: int = 48) -> list[int]:
    from hearth_llm.engine.sampling_params import SamplingParams

    engine.add_request(list(range(200, 232)), SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True,
                                                             detokenize=False))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for delta in engine.step() for t in delta.new_token_ids]
    for request_id in list(engine.groups):
        engine.release(request_id)
    return tokens


def bs1_ab(engine, args) -> dict:
    """Each :data:`BS1_VARIANTS` entry: graphs captured again, bs1 ms/token (64 tokens), graph
    device time, and greedy agreement with the first variant over 48 tokens. The math is the same,
    only the float32 summation order differs; on random weights the logits are near ties, so the
    tokens part at the first decode step (H200 round 1: after 1 token) and say little: the kernels'
    exactness is checked by ``quant_kernels --part check-fp8-row``."""
    from hearth_llm.kernels.quant import triton_fp8

    results, reference = {}, None
    for label, row in BS1_VARIANTS.items():
        triton_fp8.ROW_GEMV = row
        try:
            engine.runner.enable_cuda_graphs(min(engine.config.max_num_seqs, 512), engine.max_model_len)
            tokens = greedy_tokens(engine)
        except Exception as error:  # one variant's failure (a compile, say) leaves the others measured
            print(f"fp8 bs1 A/B {label}: FAILED {type(error).__name__}: {str(error)[:800]}", flush=True)
            continue
        reference = reference or tokens
        agree = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
        ms = ours_bs1_ms_per_token(engine, num_tokens=64)
        results[label] = {"bs1_ms_per_token": ms, "decode_graph_ms": decode_graph_bs1_ms(engine),
                          "greedy_tokens_equal_before_first_difference": agree}
        print(f"fp8 bs1 A/B {label}: {json.dumps(results[label])}", flush=True)
    return results


def _guard_engine(args, dtype: str, std: float, cuda_graphs: bool = True):
    """An FP8 engine over random weights of ``std`` (bf16 values, whatever ``dtype`` computes)."""
    from hearth_llm.engine.config import EngineConfig
    from hearth_llm.engine.llm_engine import LLMEngine
    from hearth_llm.engine.loader.checkpoint import LoadedCheckpoint

    from .random_weights import RandomWeights, checkpoint_shapes
    from .throughput import placeholder_tokenizer

    config = hf_config(args.shape, args.num_layers, 1024)
    weights = RandomWeights(checkpoint_shapes(config, torch.bfloat16), torch.bfloat16, args.device, std=std)
    checkpoint = LoadedCheckpoint(config, placeholder_tokenizer(config.vocab_size), args.shape,
                                  weight_stream=lambda: iter(weights.items()), dtype=torch.bfloat16,
                                  weight_shapes={name: (dims, args.shape) for name, dims in weights.shapes.items()})
    engine_config = EngineConfig(model=checkpoint.source, dtype=dtype, device=args.device, max_num_seqs=64,
                                 kv_cache_memory="2GiB", max_model_len=1024, show_progress=False,
                                 quantization="fp8", cuda_graphs=cuda_graphs and dtype != "float32")
    return LLMEngine(engine_config, checkpoint=checkpoint)


def _greedy_with_logprobs(engine, prompts, num_tokens: int, together: bool):
    """``[(tokens, logprob of each)]`` per prompt: all at once (``together``) or one at a time."""
    from hearth_llm.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, detokenize=False, logprobs=1)
    results = []
    for group in ([prompts] if together else [[p] for p in prompts]):
        requests = {}
        for prompt in group:
            engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                requests.setdefault(id(delta.request), delta.request)
        for request in sorted(requests.values(), key=lambda r: group.index(list(r.prompt_token_ids))):
            tokens = list(request.output_token_ids)
            results.append((tokens, [entry[token].logprob for entry, token in zip(request.logprobs, tokens)]))
        for request_id in list(engine.groups):
            engine.release(request_id)
    return results


def quality_guard(args, num_prompts: int = 32, num_alone: int = 4, num_tokens: int = 16, std: float = 0.05) -> dict:
    """Our FP8 engine (bf16, CUDA graphs, the shipped kernels) against the dequantized-fp32
    reference: the same FP8 weights and per-token activation quantization, every linear by
    ``fp8.fp8_linear_reference`` in float32, eager. Random weights of ``std`` (larger than HF's
    0.02, so the logits are not near ties); ``num_prompts`` prompts decoded together (the
    several-row kernels) and ``num_alone`` of them alone (the one-row GEMV). Per group: prompts
    whose greedy tokens equal the reference's, tokens equal before the first difference (mean),
    and the largest |Δlogprob| of the chosen token over the positions before it."""
    from hearth_llm import kernels
    from hearth_llm.kernels.quant import Fp8Weight, fp8

    generator = torch.Generator().manual_seed(7)
    vocab = hf_config(args.shape, args.num_layers, 1024).vocab_size
    prompts = [torch.randint(0, vocab, (int(torch.randint(8, 64, (1,), generator=generator)),),
                             generator=generator).tolist() for _ in range(num_prompts)]
    engine = _guard_engine(args, "bfloat16", std)
    ours = {"together": _greedy_with_logprobs(engine, prompts, num_tokens, True),
            "alone": _greedy_with_logprobs(engine, prompts[:num_alone], num_tokens, False)}
    del engine
    torch.cuda.empty_cache()
    kernels.register_linear_routine(Fp8Weight, args.device, lambda x, weight, bias: fp8.fp8_linear_reference(
        x.float(), weight.weight, weight.scale, None if bias is None else bias.float()).to(x.dtype))
    try:
        engine = _guard_engine(args, getattr(args, "reference_dtype", "float32"), std, cuda_graphs=False)  # eager
        reference = {"together": _greedy_with_logprobs(engine, prompts, num_tokens, True),
                     "alone": _greedy_with_logprobs(engine, prompts[:num_alone], num_tokens, False)}
    finally:  # the package's own routine back
        from hearth_llm.kernels.quant import _triton_fp8_linear

        kernels.register_linear_routine(Fp8Weight, args.device, _triton_fp8_linear if args.device == "cuda" else
                                        lambda x, weight, bias: fp8.fp8_linear(x, weight.weight, weight.scale, bias))
    report = {}
    for group, rows in ours.items():
        prefixes, deltas = [], [0.0]
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(rows, reference[group]):
            same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
            prefixes.append(same)
            deltas += [abs(a - b) for a, b in zip(logprobs[:same], ref_logprobs[:same])]
        report[group] = {"num_prompts": len(rows), "num_identical": sum(p == num_tokens for p in prefixes),
                         "mean_tokens_before_first_difference": sum(prefixes) / len(prefixes),
                         "max_abs_dlogprob_before_it": max(deltas)}
        print(f"fp8 quality guard {args.shape} ({args.num_layers or 'all'} layers, std {std}, reference "
              f"{getattr(args, 'reference_dtype', 'float32')}) {group}: "
              f"{json.dumps(report[group])}", flush=True)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--workloads", nargs="+", choices=("throughput", "bs1"), default=["bs1"])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer decoder layers (smoke tests)")
    parser.add_argument("--kv-cache-memory", default="40GiB")
    parser.add_argument("--kv-cache-dtype", default="auto", help='"auto" (the model dtype) or "fp8" (e4m3 cache)')
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--quality", action="store_true",
                        help="fp8: only the kernel checks (CUDA) and the quality guard against the dequantized-fp32 "
                             "reference")
    parser.add_argument("--reference-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="--quality: the reference engine's dtype; bfloat16 isolates the kernels (the "
                             "reference linears still compute in float32, the activations are bf16 as ours)")
    parser.add_argument("--no-kernel-checks", dest="kernel_checks", action="store_false",
                        help="--quality: skip the PASS/FAIL kernel checks")
    parser.add_argument("--then-fp8-kv", action="store_true",
                        help="then the throughput workload again with kv_cache_dtype='fp8' (and their ratio)")
    parser.add_argument("--no-bs1-extras", dest="bs1_extras", action="store_false",
                        help="skip our own bs1 figures after the workloads")
    parser.add_argument("--bs1-ab", action="store_true",
                        help="fp8: bs1 with the one-row GEMV and with the old several-row GEMV")
    parser.add_argument("--fast-accum", action="store_true",
                        help="fp8: torch._scaled_mm with use_fast_accum (triton_fp8.SCALED_MM_FAST_ACCUM)")
    parser.add_argument("--then-fast-accum", action="store_true",
                        help="fp8: then the throughput workload again with SCALED_MM_FAST_ACCUM flipped")
    parser.add_argument("--kernel-profile",
                        help="only the throughput workload through throughput.run_ours, with a torch.profiler table "
                             "of 20 mid-run steps written here (kernel time by name)")
    add_workload_options(parser)
    args = parser.parse_args(argv)
    args.max_model_len = args.max_model_len or 4096
    if args.fast_accum:
        from hearth_llm.kernels.quant import triton_fp8

        triton_fp8.SCALED_MM_FAST_ACCUM = True
    if args.kernel_profile:
        profile_throughput(args)
        return
    if args.quality:
        if args.device == "cuda" and args.kernel_checks:  # the kernels' exactness first (PASS/FAIL lines)
            from .quant_kernels import check_codes_gemm, check_row

            print("check fp8 row " + ("PASS" if check_row() else "FAIL"), flush=True)
            print("check fp8 codes gemm " + ("PASS" if check_codes_gemm() else "FAIL"), flush=True)
        report = quality_guard(args)
        if args.json:
            with open(args.json, "w") as sink:
                json.dump(report, sink, indent=2)
        return
    results = run(args)
    if args.then_fp8_kv:  # the same engine again with an e4m3 KV cache, in this process
        results["fp8_kv"] = run(argparse.Namespace(**{**vars(args), "kv_cache_dtype": "fp8",
                                                      "workloads": ["throughput"], "bs1_extras": False}))
        ours, fp8_kv = results.get("measures", {}), results["fp8_kv"].get("measures", {})
        if "throughput_tok_s" in ours and "throughput_tok_s" in fp8_kv:
            results["fp8_kv_throughput_ratio"] = fp8_kv["throughput_tok_s"] / ours["throughput_tok_s"]
            print(f"{args.method} {args.shape} throughput kv fp8 / kv {args.kv_cache_dtype}: "
                  f"{results['fp8_kv_throughput_ratio']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as sink:
            json.dump(results, sink, indent=2)


def profile_throughput(args) -> dict:
    """The throughput workload by ``throughput.run_ours`` (steps 300-320 profiled into
    ``args.kernel_profile``); its tok/s printed (a little low: the profiled steps run slower)."""
    from . import workloads
    from .throughput import run_ours

    engine = build_engine(args)
    requests = workloads.workload(args.num_seqs, low=args.lengths[0], high=args.lengths[1])
    result = run_ours(engine, requests, args.kernel_profile, tuple(args.lengths))
    print(f"{args.method} {args.shape} kv {args.kv_cache_dtype} profiled throughput: "
          f"{json.dumps(result)}", flush=True)
    return result


def fast_accum_throughput(engine, generate, args) -> dict:
    """The throughput workload again on the same engine with ``triton_fp8.SCALED_MM_FAST_ACCUM``
    flipped (decode graphs captured anew, then the flag restored), and its ratio to the first run."""
    from hearth_llm.kernels.quant import triton_fp8

    before = triton_fp8.SCALED_MM_FAST_ACCUM
    triton_fp8.SCALED_MM_FAST_ACCUM = not before
    try:
        engine.runner.decode_graphs = None
        gc.collect()
        engine.runner.enable_cuda_graphs(min(engine.config.max_num_seqs, 512), engine.max_model_len)
        measures = run_workloads(generate, argparse.Namespace(**{**vars(args), "workloads": ["throughput"]}))
    finally:
        triton_fp8.SCALED_MM_FAST_ACCUM = before
    result = {"scaled_mm_fast_accum": not before, **measures}
    print(f"fp8 {args.shape} throughput with SCALED_MM_FAST_ACCUM={not before}: {json.dumps(result)}", flush=True)
    return result


def run(args) -> dict:
    """One engine of ``args``: its workloads (bs1 first), then our own bs1 figures (steady decode
    of 128 tokens, the decode graph's device time) unless ``args.bs1_extras`` is False."""
    started = time.perf_counter()
    engine = build_engine(args)
    model = engine.runner.model
    results = {"shape": args.shape, "method": args.method, "kv_cache_dtype": args.kv_cache_dtype,
               "init_s": time.perf_counter() - started,
               "weight_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values())}
    print(f"{args.method} {args.shape} kv {args.kv_cache_dtype}: engine up in {results['init_s']:.1f} s, "
          f"weights {results['weight_bytes'] / 2**30:.2f} GiB", flush=True)
    if args.bs1_ab:
        results["bs1_ab"] = bs1_ab(engine, args)
        return results
    generate = engine_generate(engine)
    results["measures"] = {}
    for name in sorted(args.workloads, key=lambda w: w != "bs1"):  # bs1 first: short, printed before a kill
        results["measures"].update(run_workloads(generate, argparse.Namespace(**{**vars(args), "workloads": [name]})))
        print(f"{args.method} {args.shape} kv {args.kv_cache_dtype} {name}: {json.dumps(results['measures'])}",
              flush=True)
        if getattr(args, "json", None) and args.kv_cache_dtype == "auto":  # what ran so far survives a time limit
            with open(args.json, "w") as sink:
                json.dump(results, sink, indent=2)
    if args.bs1_extras:
        results["ours_bs1_ms_per_token"] = ours_bs1_ms_per_token(engine, num_tokens=128 if args.device == "cuda" else 8)
        if args.device == "cuda":
            results["bs1_decode_graph_ms"] = decode_graph_bs1_ms(engine)
        print(f"{args.method} {args.shape} ours_bs1_ms_per_token {results['ours_bs1_ms_per_token']:.3f}"
              f" decode graph {results.get('bs1_decode_graph_ms')}", flush=True)
    if getattr(args, "then_fast_accum", False) and args.method == "fp8":
        results["fast_accum"] = fast_accum_throughput(engine, generate, args)
    del engine, model, generate
    gc.collect()  # the KV cache and graphs go before a next engine is built
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return results

if __name__ == "__main__":
    main()
