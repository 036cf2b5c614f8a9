"""Batch-size-1 decode on CUDA: where a step's time goes, and what the fused GEMV kernels buy.

    python -m hearth_llm.benchmarks.bs1_decode                     # everything below, both shapes
    python -m hearth_llm.benchmarks.bs1_decode --parts check sweep --budget-s 40

Parts, each printed as it finishes (flushed, so a run cut short keeps what it measured):

* ``check``: the fused kernels (``kernels/gemv``) against their torch reference on bf16 real widths
  (PASS/FAIL lines); ``attention``: the attention kernels against theirs (``attention_kernels``);
* ``sweep``: each projection of the 0.6B and 8B shapes at one row: cuBLAS (``F.linear``), the
  unfused pair (norm or SwiGLU kernel, then cuBLAS) and the fused kernel over launch shapes, µs per
  call inside a CUDA graph, with enough weight copies to defeat the 50 MB L2 (each call reads HBM);
* ``engine``: an engine per shape (random weights, one sequence): ms/token as ``bench throughput``
  times it and the decode graph's device time, fused on and off, and a torch.profiler table of the
  kernels one decode graph replay runs (count and µs each).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

STARTED = time.perf_counter()

# (name, N outputs, K inputs, prologue) per projection of a layer.
PROJECTIONS = {
    "qwen3-0.6b": [("qkv", 4096, 1024, "norm"), ("o", 1024, 2048, "plain"), ("gate_up", 6144, 1024, "norm"),
                   ("down", 1024, 3072, "silu"), ("lm_head", 151936, 1024, "norm")],
    "llama3-8b": [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "plain"), ("gate_up", 28672, 4096, "norm"),
                  ("down", 4096, 14336, "silu"), ("lm_head", 128256, 4096, "norm")],
}
LAUNCHES = [(4, 512, 4), (8, 512, 4), (16, 512, 4), (4, 1024, 4), (8, 1024, 4), (16, 1024, 8), (2, 1024, 4),
            (32, 256, 4), (8, 256, 4), (32, 512, 8), (16, 256, 4), (4, 2048, 8), (16, 1024, 4)]


def say(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f}s] {message}", flush=True)


def graph_us(make_call, copies: int, calls: int = 40, replays: int = 5) -> float:
    """µs per call of ``make_call(i)`` (i cycles over ``copies`` inputs) replayed in a CUDA graph."""
    from .timing import graphed_us

    return graphed_us([make_call(i % copies) for i in range(calls)], replays, num_warmup=min(copies, 3))


def check(gemv, reference) -> bool:
    ok = True
    torch.manual_seed(0)
    for shape, projections in PROJECTIONS.items():
        for name, outputs, reduction, prologue in projections:
            x = torch.randn(1, reduction, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(outputs, reduction, device="cuda", dtype=torch.bfloat16) * reduction**-0.5
            if prologue == "norm":
                residual = torch.randn_like(x)
                norm_weight = torch.rand(reduction, device="cuda", dtype=torch.bfloat16) + 0.5
                out, summed = gemv.rms_norm_linear(x, residual, norm_weight, 1e-6, weight)
                expected, expected_summed = reference.rms_norm_linear(x, residual, norm_weight, 1e-6, weight)
                same_sum = torch.equal(summed, expected_summed)
                out0, _ = gemv.rms_norm_linear(x, None, norm_weight, 1e-6, weight)
                expected0, _ = reference.rms_norm_linear(x, None, norm_weight, 1e-6, weight)
                diff0 = (out0.float() - expected0.float()).abs().max().item()
            elif prologue == "silu":
                gate_up = torch.randn(1, 2 * reduction, device="cuda", dtype=torch.bfloat16)
                out, expected = gemv.silu_and_mul_linear(gate_up, weight), reference.silu_and_mul_linear(gate_up, weight)
                same_sum, diff0 = True, 0.0
            else:
                out, expected = gemv.linear(x, weight), reference.linear(x, weight)
                same_sum, diff0 = True, 0.0
            diff = (out.float() - expected.float()).abs().max().item()
            scale = expected.float().abs().max().item()
            passed = same_sum and diff <= 0.02 * scale + 1e-2 and diff0 <= 0.02 * scale + 1e-2
            ok &= passed
            say(f"{'PASS' if passed else 'FAIL'} gemv {shape} {name} [{outputs}x{reduction}] {prologue}: "
                f"max|diff| {diff:.3g} (no residual {diff0:.3g}) of max {scale:.3g}, sum equal {same_sum}")
    return ok


def sweep(gemv, norm_kernels, activation_kernels, budget_end: float) -> dict:
    """µs per call: cuBLAS, unfused pair, fused over LAUNCHES; returns the best launch per projection."""
    best = {}
    for shape, projections in PROJECTIONS.items():
        for name, outputs, reduction, prologue in projections:
            if time.perf_counter() > budget_end:
                say("sweep: out of time")
                return best
            weight_bytes = outputs * reduction * 2
            copies = max(1, -(-200 * 2**20 // weight_bytes))  # > 4x the L2
            weights = [torch.randn(outputs, reduction, device="cuda", dtype=torch.bfloat16) * 0.02
                       for _ in range(copies)]
            x = torch.randn(1, reduction, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn_like(x)
            norm_weight = torch.ones(reduction, device="cuda", dtype=torch.bfloat16)
            gate_up = torch.randn(1, 2 * reduction, device="cuda", dtype=torch.bfloat16)
            cublas = graph_us(lambda i: (lambda: F.linear(x, weights[i])), copies)
            if prologue == "norm":
                unfused = graph_us(lambda i: (lambda: F.linear(norm_kernels.rms_norm(x, norm_weight, 1e-6, residual)[0],
                                                               weights[i])), copies)
            elif prologue == "silu":
                unfused = graph_us(lambda i: (lambda: F.linear(activation_kernels.silu_and_mul(gate_up), weights[i])),
                                   copies)
            else:
                unfused = cublas
            results = []
            default = gemv.default_launch(outputs, reduction, {"norm": gemv.RMS_NORM, "silu": gemv.SILU_AND_MUL,
                                                               "plain": gemv.PLAIN}[prologue])
            launches = {gemv.GemvLaunch(n, min(k, 1 << (reduction - 1).bit_length()), w) for n, k, w in LAUNCHES}
            for launch in [default] + sorted(launches - {default}, key=lambda g: (g.block_n, g.block_k, g.num_warps)):
                if time.perf_counter() > budget_end:
                    break
                if prologue == "norm":
                    def make(i, launch=launch):
                        return lambda: gemv.rms_norm_linear(x, residual, norm_weight, 1e-6, weights[i], launch)
                elif prologue == "silu":
                    def make(i, launch=launch):
                        return lambda: gemv.silu_and_mul_linear(gate_up, weights[i], launch)
                else:
                    def make(i, launch=launch):
                        return lambda: gemv.linear(x, weights[i], launch)
                results.append((graph_us(make, copies), launch))
            results.sort(key=lambda item: item[0])
            cells = " ".join(f"N{g.block_n}/K{g.block_k}/w{g.num_warps}:{us:.1f}" for us, g in results)
            fastest_us, fastest = results[0]
            default_us = next((us for us, g in results if g == default), float("nan"))
            best[f"{shape}.{name}"] = dict(cublas_us=cublas, unfused_us=unfused, fused_us=fastest_us,
                                           launch=[fastest.block_n, fastest.block_k, fastest.num_warps],
                                           default_us=default_us)
            say(f"gemv {shape} {name} [{outputs}x{reduction}] {prologue}: cuBLAS {cublas:.1f}us "
                f"({weight_bytes / cublas / 1e3:.0f} GB/s) | unfused {unfused:.1f}us | fused best {fastest_us:.1f}us "
                f"({weight_bytes / fastest_us / 1e3:.0f} GB/s) N{fastest.block_n}/K{fastest.block_k}/w{fastest.num_warps}"
                f" | default {default_us:.1f}us || {cells}")
            weights.clear()  # free the copies before the next projection
    return best


def build_engine(shape: str):
    from .throughput import our_engine, random_checkpoint

    _, checkpoint = random_checkpoint(shape, torch.bfloat16, "cuda", max_model_len=4096)
    return our_engine(checkpoint, "bfloat16", max_num_seqs=1, kv_cache_memory="2GiB", max_model_len=4096)


def recapture(engine, fused: bool, fused_merge: bool = False, plain_gemv: bool = False) -> None:
    """Capture the bs1 graph again with the fused GEMVs on or off (and decode attention's fused
    merge, and o_proj by the GEMV)."""
    import dataclasses

    from hearth_llm.engine.models import fused_decode
    from hearth_llm.kernels.attention import triton_attention

    fused_decode.ENABLED = fused
    fused_decode.PLAIN_GEMV = plain_gemv
    triton_attention.DEFAULT_LAUNCH = dataclasses.replace(triton_attention.DEFAULT_LAUNCH, fused_reduce=fused_merge)
    engine.runner.decode_graphs = None
    torch.cuda.synchronize()
    engine.runner.enable_cuda_graphs(1, engine.config.max_model_len)


def _kernel_table(profiler, repeats: int) -> dict[str, list]:
    kernels: dict[str, list] = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    return {name: [count / repeats, device_us / repeats] for name, (count, device_us) in kernels.items()}


def profile_step(engine, label: str, rows: int = 40) -> None:
    """Kernels of one bs1 decode forward, by device time: the graph's replay, and the same forward
    run eagerly (its kernels one by one; CUPTI may not see inside a graph)."""
    graphs = engine.runner.decode_graphs
    graph = graphs.graphs[1]
    def eager():
        with torch.inference_mode():
            graphs._forward(1)

    for name, run in (("graph", graph.replay), ("eager", eager)):
        run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            for _ in range(10):
                run()
            torch.cuda.synchronize()
        table = _kernel_table(profiler, 10)
        count = sum(c for c, _ in table.values())
        total = sum(t for _, t in table.values())
        say(f"profile {label} {name}: {count:.0f} kernels per forward, {total:.0f} us of kernel time")
        if name == "eager" or count > 0:
            for kernel, (count, device_us) in sorted(table.items(), key=lambda item: -item[1][1])[:rows]:
                say(f"  {count:5.0f} x {device_us / count:7.2f} us = {device_us:8.1f} us  {kernel[:110]}")
            if name == "graph":
                return  # the graph's own table is the one that counts


def compare_fused(engine, shape: str, results: dict) -> None:
    """One bs1 decode forward (the graphs' last inputs, eager) with and without the fused kernels:
    logits close, same top-5."""
    from hearth_llm.engine.models import fused_decode

    graphs, model = engine.runner.decode_graphs, engine.runner.model
    logits = {}
    with torch.inference_mode():
        for fused in (True, False):
            fused_decode.ENABLED = fused
            logits[fused] = model.compute_logits(graphs._forward(1)).float()[0]
    fused_decode.ENABLED = True
    top_fused, top_unfused = logits[True].topk(5).indices.tolist(), logits[False].topk(5).indices.tolist()
    diff = (logits[True] - logits[False]).abs().max().item()
    spread = logits[False].std().item()
    overlap = len(set(top_fused) & set(top_unfused))
    passed = overlap >= 4 and top_fused[0] == top_unfused[0]
    results[f"{shape}.fused_top5_overlap"] = overlap
    say(f"{'PASS' if passed else 'FAIL'} engine {shape} fused vs unfused bs1 logits: top-5 overlap {overlap}/5, "
        f"argmax {top_fused[0]} vs {top_unfused[0]}, max|diff| {diff:.3g} (logit std {spread:.3g})")


def engine_part(shapes: list[str], budget_end: float, results: dict) -> None:
    from .throughput import decode_graph_bs1_ms, ours_bs1_ms_per_token

    for shape in shapes:
        if time.perf_counter() > budget_end:
            say(f"engine {shape}: out of time")
            return
        engine = build_engine(shape)
        say(f"engine {shape}: built")
        for fused, fused_merge, plain_gemv in ((True, False, False), (False, False, False), (True, True, False),
                                               (True, True, True)):
            recapture(engine, fused, fused_merge, plain_gemv)
            ms = ours_bs1_ms_per_token(engine, num_tokens=64)
            graph_ms = decode_graph_bs1_ms(engine)
            label = f"{'fused' if fused else 'unfused'}{'+merge' if fused_merge else ''}{'+o_gemv' if plain_gemv else ''}"
            results[f"{shape}.bs1_ms.{label}"] = ms
            results[f"{shape}.graph_ms.{label}"] = graph_ms
            say(f"BS1 {shape} {label}: {ms:.3f} ms/token, decode graph {graph_ms:.3f} ms")
            if time.perf_counter() < budget_end and not fused_merge:
                profile_step(engine, f"{shape} {label}", rows=14 if fused else 10)
        compare_fused(engine, shape, results)
        recapture(engine, True)
        del engine
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["check", "attention", "engine", "sweep", "flash"],
                        choices=["check", "attention", "sweep", "engine", "flash"])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama3-8b"])
    parser.add_argument("--budget-s", type=float, default=80.0, help="stop starting new measurements after this")
    parser.add_argument("--sweep-budget-s", type=float, default=None, help="when the sweep stops (default: budget)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from hearth_llm.kernels.activation import triton_activation
    from hearth_llm.kernels.gemv import reference, triton_gemv
    from hearth_llm.kernels.norm import triton_norm

    say(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    results: dict = {}
    budget_end = STARTED + args.budget_s
    for part in args.parts:
        try:
            run_part(part, args, results, budget_end, triton_gemv, reference, triton_norm, triton_activation)
        except Exception as error:  # noqa: BLE001  (one part failing must not lose the others)
            import traceback

            say(f"FAIL part {part}: {type(error).__name__}: {error}")
            traceback.print_exc()
        if args.json:
            with open(args.json, "w") as sink:
                json.dump(results, sink, indent=2)
    say("RESULTS " + json.dumps(results))


def run_part(part, args, results, budget_end, triton_gemv, reference, triton_norm, triton_activation) -> None:
    if part == "check":
        results["check_passed"] = check(triton_gemv, reference)
    elif part == "attention":  # the attention kernels' closeness (attention_kernels --check's first part)
        from .attention_kernels import check_closeness, fused_reduce_comparison

        check_closeness(say)
        fused_reduce_comparison(say)
    elif part == "flash":  # long-context prefill: our kernel vs torch's FlashAttention-2 (attention_kernels)
        from .attention_kernels import flash_prefill_comparison

        if time.perf_counter() < budget_end:
            flash_prefill_comparison(say)
    elif part == "sweep":
        sweep_end = STARTED + (args.sweep_budget_s or args.budget_s)
        results["sweep"] = sweep(triton_gemv, triton_norm, triton_activation, min(sweep_end, budget_end))
    else:
        engine_part(args.shapes, budget_end, results)


if __name__ == "__main__":
    main()
