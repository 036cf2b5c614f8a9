"""Batch-size-1 decode on CUDA: where a step's time goes, and what the fused GEMV kernels buy.

    python -m hearth_llm.benchmarks.bs1_decode --parts engine                  # variants A/B, both shapes
    python -m hearth_llm.benchmarks.bs1_decode --parts engine --shapes llama3-8b --variants fused fused+pdl+all+head+epi
    python -m hearth_llm.benchmarks.bs1_decode --parts sweep --quick-sweep --sweep-set decode
    python -m hearth_llm.benchmarks.bs1_decode --parts host --shapes qwen3-0.6b

Parts, each printed as it finishes (flushed, so a run cut short keeps what it measured):

* ``check``: the fused kernels (``kernels/gemv``) against their torch reference on bf16 real widths
  (PASS/FAIL lines); ``attention``: the attention kernels against theirs (``attention_kernels``);
* ``sweep``: each projection of the 0.6B and 8B shapes at one row: cuBLAS (``F.linear``), the
  unfused ops and the fused kernel over launch shapes (with and without programmatic dependent
  launch), µs per call inside a CUDA graph, with enough weight copies to defeat the 50 MB L2;
  ``--sweep-set decode`` takes the projections as the default decode path runs them;
* ``engine``: an engine per shape (random weights, one sequence) and the :data:`VARIANTS` asked for:
  ms/token as ``bench throughput`` times it and the decode graph's device time each; for the plain
  fused one and the fastest, a middle layer's kernels one by one (µs, gap before each, GB/s of the
  matmuls); for the fastest, graph vs eager and top-5 vs unfused, the host/device split of a step,
  the LM head by cuBLAS and by the GEMV, the argmax, and every device op of whole steps;
* ``host``: where the host's time of a step goes (timers around its pieces, cProfile).
"""
from __future__ import annotations

import argparse
import json
import re
import time

import torch
import torch.nn.functional as F

STARTED = time.perf_counter()

# (name, N outputs, K inputs, prologue) per projection of a layer.
PROJECTIONS = {
    "qwen3-0.6b": [("qkv", 4096, 1024, "norm"), ("o", 1024, 2048, "plain"), ("gate_up", 6144, 1024, "norm"),
                   ("down", 1024, 3072, "silu"), ("lm_head", 151936, 1024, "plain")],
    "llama3-8b": [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "plain"), ("gate_up", 28672, 4096, "norm"),
                  ("down", 4096, 14336, "silu"), ("lm_head", 128256, 4096, "plain")],
}
# The projections as the default decode path runs them (SwiGLU as gate_up's epilogue, down_proj a
# plain GEMV), for --sweep-set decode.
DECODE_PROJECTIONS = {
    "qwen3-0.6b": [("qkv", 4096, 1024, "norm"), ("o", 1024, 2048, "plain"), ("gate_up", 6144, 1024, "gated"),
                   ("down", 1024, 3072, "plain")],
    "llama3-8b": [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "plain"), ("gate_up", 28672, 4096, "gated"),
                  ("down", 4096, 14336, "plain")],
}
# A few launches per prologue for a short sweep (--quick-sweep), besides the default:
# (outputs a program, K tile, warps, prefetch the next K tile).
QUICK_LAUNCHES = {"norm": [(16, 1024, 4, False), (8, 512, 4, True), (16, 512, 4, False), (4, 1024, 4, True)],
                  "silu": [(8, 1024, 4, False), (8, 1024, 4, True), (16, 512, 4, False), (4, 1024, 4, True)],
                  "plain": [(4, 1024, 4, True), (2, 1024, 4, True), (4, 512, 4, False), (8, 512, 4, True)],
                  "gated": [(2, 1024, 4, False), (4, 512, 4, False), (8, 512, 4, False), (2, 1024, 4, True),
                            (8, 1024, 8, False)]}
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
                if name == "gate_up":  # and with SwiGLU as the epilogue
                    act, act_summed = gemv.rms_norm_linear_silu_and_mul(x, residual, norm_weight, 1e-6, weight)
                    expected_act, _ = reference.rms_norm_linear_silu_and_mul(x, residual, norm_weight, 1e-6, weight)
                    act_diff = (act.float() - expected_act.float()).abs().max().item()
                    act_scale = expected_act.float().abs().max().item()
                    act_ok = act_diff <= 0.02 * act_scale + 1e-2 and torch.equal(act_summed, expected_summed)
                    ok &= act_ok
                    say(f"{'PASS' if act_ok else 'FAIL'} gemv {shape} gate_up+SwiGLU epilogue: max|diff| "
                        f"{act_diff:.3g} of max {act_scale:.3g}")
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


def _launch_name(launch) -> str:
    return f"N{launch.block_n}/K{launch.block_k}/w{launch.num_warps}{'/pf' if launch.prefetch else ''}"


def sweep(gemv, norm_kernels, activation_kernels, budget_end: float, quick: bool = False,
          shapes: list[str] | None = None, projection_set: dict | None = None) -> dict:
    """µs per call: cuBLAS, unfused pair, fused over LAUNCHES (QUICK_LAUNCHES when ``quick``) with
    programmatic dependent launch, and the default launch without it; returns the best launch per
    projection. Consecutive calls in the graph are GEMVs of the same shape, so PDL's overlap of one
    call's start with the previous call's tail is in the numbers, as between a layer's GEMVs."""
    best = {}
    if _DEFAULT_LAUNCH is not None:  # an engine variant may have left its own in place
        gemv.default_launch = _DEFAULT_LAUNCH
    for shape, projections in (projection_set or PROJECTIONS).items():
        if shapes is not None and shape not in shapes:
            continue
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
            elif prologue == "gated":  # RMSNorm, cuBLAS, SwiGLU: three launches
                unfused = graph_us(lambda i: (lambda: activation_kernels.silu_and_mul(F.linear(
                    norm_kernels.rms_norm(x, norm_weight, 1e-6, residual)[0], weights[i]))), copies)
            else:
                unfused = cublas
            results = []
            if prologue == "gated":
                default = gemv.default_launch(outputs // 2, reduction, gemv.RMS_NORM, True)
            else:
                default = gemv.default_launch(outputs, reduction, {"norm": gemv.RMS_NORM, "silu": gemv.SILU_AND_MUL,
                                                                   "plain": gemv.PLAIN}[prologue])
            tiles = QUICK_LAUNCHES[prologue] if quick else LAUNCHES
            launches = {gemv.GemvLaunch(tile[0], min(tile[1], 1 << (reduction - 1).bit_length()), *tile[2:])
                        for tile in tiles}
            no_pdl_us = float("nan")
            for launch in [default] + sorted(launches - {default}, key=lambda g: (g.block_n, g.block_k, g.num_warps,
                                                                                 g.prefetch)):
                if time.perf_counter() > budget_end:
                    break
                if prologue == "norm":
                    def make(i, launch=launch):
                        return lambda: gemv.rms_norm_linear(x, residual, norm_weight, 1e-6, weights[i], launch)
                elif prologue == "silu":
                    def make(i, launch=launch):
                        return lambda: gemv.silu_and_mul_linear(gate_up, weights[i], launch)
                elif prologue == "gated":
                    def make(i, launch=launch):
                        return lambda: gemv.rms_norm_linear_silu_and_mul(x, residual, norm_weight, 1e-6, weights[i],
                                                                         launch)
                else:
                    def make(i, launch=launch):
                        return lambda: gemv.linear(x, weights[i], launch)
                if launch == default:
                    gemv.USE_PDL = False
                    no_pdl_us = graph_us(make, copies)
                    gemv.USE_PDL = True
                results.append((graph_us(make, copies), launch))
            results.sort(key=lambda item: item[0])
            cells = " ".join(f"{_launch_name(g)}:{us:.1f}" for us, g in results)
            fastest_us, fastest = results[0]
            default_us = next((us for us, g in results if g == default), float("nan"))
            best[f"{shape}.{name}"] = dict(cublas_us=cublas, unfused_us=unfused, fused_us=fastest_us,
                                           launch=[fastest.block_n, fastest.block_k, fastest.num_warps, fastest.prefetch],
                                           default_us=default_us, default_no_pdl_us=no_pdl_us)
            say(f"gemv {shape} {name} [{outputs}x{reduction}] {prologue}: cuBLAS {cublas:.1f}us "
                f"({weight_bytes / cublas / 1e3:.0f} GB/s) | unfused {unfused:.1f}us | fused best {fastest_us:.1f}us "
                f"({weight_bytes / fastest_us / 1e3:.0f} GB/s) {_launch_name(fastest)}"
                f" | default {default_us:.1f}us (no PDL {no_pdl_us:.1f}) || {cells}")
            weights.clear()  # free the copies before the next projection
    return best


def build_engine(shape: str):
    from .throughput import our_engine, random_checkpoint

    _, checkpoint = random_checkpoint(shape, torch.bfloat16, "cuda", max_model_len=4096)
    return our_engine(checkpoint, "bfloat16", max_num_seqs=1, kv_cache_memory="2GiB", max_model_len=4096)


# Engine variants timed one after another on the same engine, each captured afresh. A label is
# "unfused" or "fused" plus options: "+pdl" programmatic dependent launch, "+all" every weight by the
# GEMV (else those over 2^25 elements stay on cuBLAS), "+head" the LM head by the GEMV, "+epi"
# SwiGLU as gate_up's epilogue, "+pf" every default launch prefetching the next K tile, "+n16" the
# RMSNorm GEMV at 16 outputs a program (the default before the norm took one pass), "+n8" at 8 (the
# default below K 4096; at K >= 4096 it is 16 x 512 since round 2), "+apdl" decode attention with
# programmatic dependent launch (DecodeLaunch.use_pdl),
# "+gh" the one-row graph ending in the LM head and the greedy argmax (cuda_graphs.HEAD_SIZES), "+few"
# decode steps of a few sequences built in plain Python and staged into the graphs' buffers in one
# copy (model_runner.MAX_FEW_DECODE_SEQS). Launch tweaks: "+qn4"/"+qk512"/"+qw8" the qkv (RMSNorm)
# GEMV at 4 outputs / K tiles of 512 / 8 warps, "+gn2"/"+gn8"/"+gk512" the SwiGLU-epilogue gate_up GEMV
# at 2 or 8 outputs / K tiles of 512, "+as64" decode attention pieces of at least 64 keys (DecodeLaunch.min_split_tokens),
# "+ab32" its key tiles of 32; "+pp" / "+pa" the plain (o_proj, down, LM head) / every GEMV loading
# two weight tiles before it waits for the previous kernel (GemvLaunch.preload).
VARIANTS = ["unfused", "fused", "fused+pdl", "fused+pdl+head", "fused+pdl+all", "fused+pdl+all+head",
            "fused+pdl+all+head+epi", "fused+pdl+head+epi", "fused+pdl+all+head+pf", "fused+pdl+head+pf",
            "fused+pdl+all+head+epi+pf", "fused+pdl+all+head+n16", "fused+pdl+all+head+epi+n8",
            "fused+pdl+all+head+epi+targ", "fused+pdl+all+head+epi+apdl", "fused+pdl+all+head+epi+apdl+n16",
            "fused+pdl+all+head+epi+apdl+gh", "fused+pdl+all+head+epi+apdl+gh+few"]
_DEFAULT_LAUNCH = None
_ATTENTION_LAUNCH = None
_SPLIT_ARGMAX_MAX_ROWS = 16  # kernels/sampling/triton_sampling's


_TWEAK = re.compile(r"^(qn|qk|qw|gn|gk|as|ab)(\d+)$")


def variant_options(label: str) -> dict:
    base, *options = label.split("+")
    tweaks = tuple(sorted((m.group(1), int(m.group(2))) for m in map(_TWEAK.match, options) if m))
    unknown = set(options) - {"pdl", "all", "head", "epi", "pf", "n16", "n8", "targ", "apdl", "gh", "few", "pp", "pa"}
    unknown -= {option for option in options if _TWEAK.match(option)}
    if base not in ("fused", "unfused") or unknown:
        raise ValueError(f"variant {label!r}: unknown parts {sorted(unknown) or base!r}")
    return dict(fused=base == "fused", pdl="pdl" in options, all="all" in options, head="head" in options,
                epi="epi" in options, pf="pf" in options, n16="n16" in options, n8="n8" in options,
                targ="targ" in options, apdl="apdl" in options, gh="gh" in options,
                few="few" in options, pp="pp" in options, pa="pa" in options, tweaks=tweaks)


def apply_variant(label: str) -> None:
    import dataclasses

    from hearth_llm.engine import cuda_graphs, model_runner
    from hearth_llm.engine.models import fused_decode
    from hearth_llm.kernels.attention import triton_attention
    from hearth_llm.kernels.gemv import triton_gemv
    from hearth_llm.kernels.sampling import triton_sampling

    global _DEFAULT_LAUNCH, _ATTENTION_LAUNCH
    if _DEFAULT_LAUNCH is None:
        _DEFAULT_LAUNCH = triton_gemv.default_launch
        _ATTENTION_LAUNCH = triton_attention.DEFAULT_LAUNCH
    options = variant_options(label)
    fused_decode.ENABLED = options["fused"]
    fused_decode.MAX_WEIGHT_NUMEL = float("inf") if options["all"] else 1 << 25
    fused_decode.LM_HEAD_GEMV = options["head"]
    fused_decode.SWIGLU_EPILOGUE = options["epi"]
    triton_gemv.USE_PDL = options["pdl"]
    cuda_graphs.HEAD_SIZES = frozenset({1}) if options["gh"] else frozenset()
    model_runner.MAX_FEW_DECODE_SEQS = 8 if options["few"] else 0
    tweaks = dict(options["tweaks"])
    triton_attention.DEFAULT_LAUNCH = dataclasses.replace(
        _ATTENTION_LAUNCH, use_pdl=options["apdl"],
        min_split_tokens=tweaks.get("as", _ATTENTION_LAUNCH.min_split_tokens),
        block_n=tweaks.get("ab", _ATTENTION_LAUNCH.block_n))
    triton_sampling.SPLIT_ARGMAX_MAX_ROWS = 0 if options["targ"] else _SPLIT_ARGMAX_MAX_ROWS
    def launch(num_outputs, reduction, prologue=triton_gemv.PLAIN, gated_out=False):
        chosen = _DEFAULT_LAUNCH(num_outputs, reduction, prologue, gated_out)
        if (options["n16"] or options["n8"]) and prologue == triton_gemv.RMS_NORM and not gated_out:
            chosen = dataclasses.replace(chosen, block_n=16 if options["n16"] else 8)
        if prologue == triton_gemv.RMS_NORM and not gated_out:
            chosen = dataclasses.replace(chosen, block_n=tweaks.get("qn", chosen.block_n),
                                         block_k=min(chosen.block_k, tweaks.get("qk", chosen.block_k)),
                                         num_warps=tweaks.get("qw", chosen.num_warps))
        if prologue == triton_gemv.RMS_NORM and gated_out:
            chosen = dataclasses.replace(chosen, block_n=tweaks.get("gn", chosen.block_n),
                                         block_k=min(chosen.block_k, tweaks.get("gk", chosen.block_k)))
        if options["pa"] or (options["pp"] and prologue == triton_gemv.PLAIN):
            chosen = dataclasses.replace(chosen, preload=True)
        return dataclasses.replace(chosen, prefetch=True) if options["pf"] else chosen

    is_tweaked = (options["pf"] or options["n16"] or options["n8"] or options["pp"] or options["pa"]
                  or any(k not in ("as", "ab") for k, _ in options["tweaks"]))
    triton_gemv.default_launch = launch if is_tweaked else _DEFAULT_LAUNCH


def recapture(engine, label: str) -> None:
    """Capture the bs1 graph again under one of :data:`VARIANTS`."""
    apply_variant(label)
    engine.runner.decode_graphs = None
    torch.cuda.synchronize()
    engine.runner.enable_cuda_graphs(1, engine.config.max_model_len)


def _device_events(profiler) -> list:
    return sorted((e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def _kernel_table(profiler, repeats: int) -> dict[str, list]:
    kernels: dict[str, list] = {}
    for event in _device_events(profiler):
        entry = kernels.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us()
    return {name: [count / repeats, device_us / repeats] for name, (count, device_us) in kernels.items()}


def _is_matmul(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in ("gemv", "gemm", "nvjet", "cutlass", "xmma"))


def layer_timeline(engine, shape: str, label: str, results: dict) -> None:
    """One graph replay kernel by kernel: a middle layer's kernels in order, each with its device µs,
    the gap since the previous kernel ended (negative: it overlapped, PDL), and GB/s for the
    matmuls (their weights by position: qkv, o, gate_up, down); totals of kernel time and gaps."""
    graph = engine.runner.decode_graphs.graphs[1]
    num_layers = engine.runner.arch.num_hidden_layers
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        graph.replay()
        torch.cuda.synchronize()
    events = _device_events(profiler)
    if not events:  # CUPTI did not see inside the graph: the same forward eagerly (gaps then include the host)
        say(f"timeline {shape} {label}: the profiler saw no kernels inside the graph; eager forward instead")
        with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            engine.runner.decode_graphs._forward(1)
            torch.cuda.synchronize()
        events = _device_events(profiler)
        if not events:
            return
    busy = sum(e.time_range.elapsed_us() for e in events)
    span = events[-1].time_range.end - events[0].time_range.start
    gaps = [events[i].time_range.start - events[i - 1].time_range.end for i in range(1, len(events))]
    say(f"timeline {shape} {label}: {len(events)} kernels, span {span:.0f} us, kernel time {busy:.0f} us, "
        f"sum of gaps {sum(gaps):.0f} us (positive {sum(g for g in gaps if g > 0):.0f})")
    rope = [i for i, e in enumerate(events) if "rope" in e.name or "rotary" in e.name]
    if len(rope) < 2 or (rope[-1] - rope[0]) % (num_layers - 1):
        say(f"timeline {shape} {label}: no per-layer pattern found (rope kernels at {rope[:3]}...)")
        return
    period = (rope[-1] - rope[0]) // (num_layers - 1)
    first = rope[0] - 1  # the qkv matmul before the first rope kernel
    weights = {name: outputs * reduction * 2 for name, outputs, reduction, _ in PROJECTIONS[shape]}
    names = ["qkv", "o", "gate_up", "down"]
    layers = range(2, num_layers - 1)
    rows, matmul_index, layer_us = [], 0, 0.0
    for slot in range(period):
        picked = [events[first + layer * period + slot] for layer in layers]
        us = sum(e.time_range.elapsed_us() for e in picked) / len(picked)
        gap = sum(e.time_range.start - events[first + layer * period + slot - 1].time_range.end
                  for layer, e in zip(layers, picked)) / len(picked)
        name = picked[0].name
        note = ""
        if _is_matmul(name) and matmul_index < len(names):
            proj = names[matmul_index]
            note = f"  [{proj} {weights[proj] / us / 1e3:.0f} GB/s]"
            matmul_index += 1
        layer_us += us + gap
        rows.append((slot, us, gap, name, note))
    say(f"  one layer ({period} kernels, layers 2..{num_layers - 2} averaged): {layer_us:.1f} us incl. gaps")
    for slot, us, gap, name, note in rows:
        say(f"  slot {slot}: {us:7.2f} us, gap before {gap:6.2f} us  {name[:90]}{note}")
    head = [e for e in events[:first]] + [e for e in events[first + num_layers * period:]]
    for e in head:
        say(f"  outside the layers: {e.time_range.elapsed_us():7.2f} us  {e.name[:90]}")
    results[f"{shape}.{label}.layer_us"] = layer_us
    results[f"{shape}.{label}.graph_gaps_us"] = sum(gaps)


def profile_steps(engine, shape: str, label: str, num_steps: int = 10, rows: int = 24) -> None:
    """Every device operation of ``num_steps`` whole engine steps (graph, input copies, LM head,
    argmax, copies to the host), per step, by device time."""
    from hearth_llm.engine.sampling_params import SamplingParams

    engine.add_request(list(range(100, 132)), SamplingParams(temperature=0, max_tokens=num_steps + 8, ignore_eos=True,
                                                            detokenize=False))
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    for rid in list(engine.groups):
        engine.release(rid)
    table = _kernel_table(profiler, num_steps)
    total = sum(t for _, t in table.values())
    say(f"steps {shape} {label}: {sum(c for c, _ in table.values()):.0f} device ops per step, {total:.0f} us "
        f"(graph kernels included)")
    for kernel, (count, device_us) in sorted(table.items(), key=lambda item: -item[1][1])[:rows]:
        say(f"  {count:5.1f} x {device_us / max(count, 1e-9):7.2f} us = {device_us:8.1f} us  {kernel[:100]}")


def host_split(engine, shape: str, label: str, results: dict, num_tokens: int = 32) -> None:
    """ms/token as ``bench throughput`` times it, split into the host's time in ``engine.step``
    outside waits, the time it waits for the device's tokens, and ``runner.run``'s host time."""
    from hearth_llm.engine import sampler

    spent = {"wait": 0.0, "run": 0.0, "steps": 0}
    original_to_host, original_run = sampler.SampledTokens.to_host, engine.runner.run

    def timed_to_host(self):
        started = time.perf_counter()
        if self.ready is not None:
            self.ready.synchronize()
        spent["wait"] += time.perf_counter() - started
        return original_to_host(self)

    def timed_run(*args, **kwargs):
        started = time.perf_counter()
        out = original_run(*args, **kwargs)
        spent["run"] += time.perf_counter() - started
        spent["steps"] += 1
        return out

    sampler.SampledTokens.to_host = timed_to_host
    engine.runner.run = timed_run
    try:
        from hearth_llm.engine.sampling_params import SamplingParams

        engine.add_request(list(range(100, 132)), SamplingParams(
            temperature=0, max_tokens=num_tokens + 3, ignore_eos=True, detokenize=False))
        for _ in range(3):  # the prefill and the first decode steps: not timed
            engine.step()
        torch.cuda.synchronize()
        spent.update(wait=0.0, run=0.0, steps=0)
        started = time.perf_counter()
        for _ in range(num_tokens):
            engine.step()
        ms = (time.perf_counter() - started) * 1e3 / num_tokens
        while engine.has_unfinished_requests():
            engine.step()
        for rid in list(engine.groups):
            engine.release(rid)
    finally:
        sampler.SampledTokens.to_host = original_to_host
        del engine.runner.run
    steps = max(spent["steps"], 1)
    wait_ms, run_ms = spent["wait"] * 1e3 / steps, spent["run"] * 1e3 / steps
    results[f"{shape}.{label}.host_ms_per_step"] = ms - wait_ms
    say(f"host {shape} {label}: {ms:.3f} ms/token; per step the host waits {wait_ms:.3f} ms for the device, "
        f"is busy {ms - wait_ms:.3f} ms ({run_ms:.3f} in runner.run incl. launches)")


def head_and_argmax(engine, shape: str, label: str, results: dict) -> None:
    """Device µs of the LM head on one row (and its GB/s) and of the greedy argmax over its logits."""
    from hearth_llm import kernels
    from .timing import graphed_us

    from hearth_llm.kernels.gemv import triton_gemv

    model = engine.runner.model
    hidden = torch.randn(1, engine.runner.arch.hidden_size, device="cuda", dtype=torch.bfloat16)
    weight = model.lm_head.weight
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
        head_us = graphed_us([lambda: model.compute_logits(hidden)] * 4, replays=5)
        cublas_us = graphed_us([lambda: F.linear(hidden, weight)] * 4, replays=5)
        gemv_us = graphed_us([lambda: triton_gemv.linear(hidden, weight)] * 4, replays=5)
        argmax_us = graphed_us([lambda: kernels.argmax(logits)] * 10, replays=5)
        torch_argmax_us = graphed_us([lambda: logits.argmax(dim=-1)] * 10, replays=5)
    head_bytes = weight.numel() * weight.element_size()
    results[f"{shape}.{label}.lm_head_us"] = head_us
    results[f"{shape}.{label}.argmax_us"] = argmax_us
    say(f"head {shape} {label}: LM head as run {head_us:.1f} us ({head_bytes / head_us / 1e3:.0f} GB/s of "
        f"{head_bytes / 1e9:.2f} GB); cuBLAS {cublas_us:.1f}, GEMV {gemv_us:.1f} (4 in a row); argmax {argmax_us:.1f} us "
        f"(torch's {torch_argmax_us:.1f})")


def compare_fused(engine, shape: str, label: str, results: dict) -> None:
    """One bs1 decode forward (the graphs' last inputs, eager) under ``label`` and unfused:
    logits close, same top-5."""
    graphs, model = engine.runner.decode_graphs, engine.runner.model
    logits = {}
    with torch.inference_mode():
        # The captured graph (PDL edges and all) against the same forward run eagerly.
        graphs.graphs[1].replay()
        replayed = graphs.outputs[1].float().clone()
        eager = graphs._forward(1).float()
        graph_diff = (replayed - eager).abs().max().item()
        results[f"{shape}.{label}.graph_vs_eager_max_diff"] = graph_diff
        say(f"{'PASS' if graph_diff <= 1e-2 * eager.abs().max().item() else 'FAIL'} engine {shape} {label}: "
            f"graph replay vs eager forward max|diff| {graph_diff:.3g} (of max {eager.abs().max().item():.3g})")
        for variant in (label, "unfused"):
            apply_variant(variant)
            logits[variant] = model.compute_logits(graphs._forward(1)).float()[0]
    apply_variant(label)
    ours, theirs = logits[label], logits["unfused"]
    top_fused, top_unfused = ours.topk(5).indices.tolist(), theirs.topk(5).indices.tolist()
    diff = (ours - theirs).abs().max().item()
    spread = theirs.std().item()
    overlap = len(set(top_fused) & set(top_unfused))
    passed = overlap >= 4 and top_fused[0] == top_unfused[0]
    results[f"{shape}.{label}.top5_overlap"] = overlap
    say(f"{'PASS' if passed else 'FAIL'} engine {shape} {label} vs unfused bs1 logits: top-5 overlap {overlap}/5, "
        f"argmax {top_fused[0]} vs {top_unfused[0]}, max|diff| {diff:.3g} (logit std {spread:.3g})")


def greedy_tokens(engine, num_tokens: int = 48) -> list[int]:
    """One sequence's greedy tokens from the engine as it stands (graphs or eager)."""
    from hearth_llm.engine.sampling_params import SamplingParams

    request_id = engine.add_request(list(range(100, 132)), SamplingParams(
        temperature=0, max_tokens=num_tokens, ignore_eos=True, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()
    tokens = list(engine.groups[request_id][0].output_token_ids)
    engine.release(request_id)
    return tokens


def token_check(engine, shape: str, label: str, results: dict) -> None:
    """Greedy tokens under ``label`` (graphs) against: the same eagerly, and graphs without the
    programmatic dependent launches (same kernels, so bitwise the same tokens are expected);
    against the unfused path the count of equal leading tokens (bf16 rounding may part them)."""
    reference = None
    for name, variant, eager in ((label, label, False), ("eager", label, True),
                                 ("no-pdl", label.replace("+apdl", "").replace("+pdl", ""), False),
                                 ("unfused", "unfused", False)):
        recapture(engine, variant)
        if eager:
            engine.runner.decode_graphs = None
        tokens = greedy_tokens(engine)
        if reference is None:
            reference = tokens
            continue
        same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(reference))
        exact = name != "unfused"
        results[f"{shape}.{label}.tokens_equal_{name}"] = same
        verdict = ("PASS" if same == len(reference) else "FAIL") if exact else "INFO"
        say(f"{verdict} tokens {shape} {label} vs {name}: first {same}/{len(reference)} greedy tokens equal")
    recapture(engine, label)


def engine_part(shapes: list[str], variants: list[str], budget_end: float, results: dict) -> None:
    from .throughput import decode_graph_bs1_ms, ours_bs1_ms_per_token

    for index, shape in enumerate(shapes):
        now = time.perf_counter()
        if now > budget_end:
            say(f"engine {shape}: out of time")
            return
        # The first shapes get 60% of what is left each, so the last one still gets measured.
        shape_end = now + (budget_end - now) * (0.6 if index < len(shapes) - 1 else 1.0)
        engine = build_engine(shape)
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
        if "copy_bandwidth_TBps" not in results:
            from .throughput import copy_bandwidth_bytes_per_s

            results["copy_bandwidth_TBps"] = copy_bandwidth_bytes_per_s(torch.device("cuda")) / 1e12
        floor_ms = weight_bytes / (results["copy_bandwidth_TBps"] * 1e12) * 1e3
        model = engine.runner.model
        embedding = model.embed_tokens.weight
        # A step reads one row of an untied embedding table, not all of it.
        read_bytes = weight_bytes - (0 if embedding is model.lm_head.weight else embedding.numel() * embedding.element_size())
        read_floor_ms = read_bytes / (results["copy_bandwidth_TBps"] * 1e12) * 1e3
        results[f"{shape}.weight_read_floor_ms"] = floor_ms
        results[f"{shape}.step_read_floor_ms"] = read_floor_ms
        say(f"engine {shape}: built; weights {weight_bytes / 1e9:.2f} GB, copy bandwidth "
            f"{results['copy_bandwidth_TBps']:.2f} TB/s, weight-read floor {floor_ms:.3f} ms (bench throughput's), "
            f"{read_floor_ms:.3f} ms for the {read_bytes / 1e9:.2f} GB a step reads")
        best, seen, num_runs = None, set(), {}
        largest = max(outputs * reduction for name, outputs, reduction, _ in PROJECTIONS.get(shape, [])
                      if name != "lm_head") if shape in PROJECTIONS else float("inf")
        for label in variants:
            only_on, _, label = label.rpartition(":")  # "llama3-8b:fused+...": that shape only
            if only_on and only_on != shape:
                continue
            options = variant_options(label)
            options["all"] = options["all"] or largest <= 1 << 25
            if shape in PROJECTIONS:  # options that change nothing on this shape
                options["n8"] = options["n8"] and PROJECTIONS[shape][0][2] >= 4096
                options["targ"] = options["targ"] and PROJECTIONS[shape][-1][1] < 131072
            effective = tuple(sorted(options.items()))
            # e.g. "+all" where every weight is under the limit anyway (a label named again runs again: drift)
            if effective in seen and label not in num_runs:
                continue
            seen.add(effective)
            if time.perf_counter() > shape_end:
                say(f"engine {shape}: out of time before {label}")
                break
            try:
                recapture(engine, label)
                ms = ours_bs1_ms_per_token(engine, num_tokens=64)
                graph_ms = decode_graph_bs1_ms(engine)
            except Exception as error:  # noqa: BLE001  (one variant failing must not lose the others)
                say(f"FAIL engine {shape} {label}: {type(error).__name__}: {error}")
                continue
            num_runs[label] = num_runs.get(label, 0) + 1
            run = "" if num_runs[label] == 1 else f"#{num_runs[label]}"
            results[f"{shape}.bs1_ms.{label}{run}"] = ms
            results[f"{shape}.graph_ms.{label}{run}"] = graph_ms
            say(f"BS1 {shape} {label}{run}: {ms:.3f} ms/token, decode graph {graph_ms:.3f} ms")
            if label == "fused":  # the step before PDL and the rest, kernel by kernel
                try:
                    layer_timeline(engine, shape, label, results)
                except Exception as error:  # noqa: BLE001
                    say(f"FAIL layer_timeline {shape} {label}: {type(error).__name__}: {error}")
            if label != "unfused" and (best is None or ms < best[0]):
                best = (ms, label)
        if best is not None:
            label = best[1]
            say(f"engine {shape}: fastest {label} ({best[0]:.3f} ms/token); its accounting:")
            recapture(engine, label)
            for part in (compare_fused, token_check, host_split, head_and_argmax, layer_timeline):
                if time.perf_counter() > shape_end + 6:
                    break
                try:
                    part(engine, shape, label, results)
                except Exception as error:  # noqa: BLE001  (accounting is best-effort)
                    say(f"FAIL {part.__name__} {shape}: {type(error).__name__}: {error}")
            if time.perf_counter() < shape_end + 3:
                try:
                    profile_steps(engine, shape, label)
                except Exception as error:  # noqa: BLE001
                    say(f"FAIL profile_steps {shape}: {type(error).__name__}: {error}")
        del engine
        torch.cuda.empty_cache()


def host_part(shapes: list[str], results: dict, num_steps: int = 200, repeats: int = 5) -> None:
    """Where the host's time of a bs1 step goes (each shape at its default settings): ms/token
    ``repeats`` times (its spread), host µs per step in each piece of the step (timers around
    ``_prepare_inputs``, the graph's input copies and replay, the LM head, the sampler, the update),
    then a cProfile of ``num_steps`` steps by own time."""
    import cProfile
    import io
    import pstats

    from .throughput import ours_bs1_ms_per_token

    for shape in shapes:
        engine = build_engine(shape)
        runs = [ours_bs1_ms_per_token(engine, num_tokens=64) for _ in range(repeats)]
        results[f"{shape}.host.bs1_ms_runs"] = runs
        say(f"host {shape}: bs1 ms/token over {repeats} runs: {' '.join(f'{ms:.3f}' for ms in runs)}")
        spent: dict[str, float] = {}
        patched = []

        def timed(owner, name, label):
            original = getattr(owner, name)
            was_own = name in getattr(owner, "__dict__", {})

            def wrapper(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - started

            setattr(owner, name, wrapper)
            patched.append((owner, name, original, was_own))

        runner = engine.runner
        graphs = runner.decode_graphs
        timed(runner, "_prepare_inputs", "runner._prepare_inputs")
        timed(runner, "run", "runner.run (all)")
        if graphs is not None:
            timed(graphs, "run", "graphs.run (copies + replay)")
            if hasattr(graphs, "stage"):  # few-decodes steps: inputs staged in one copy, then replayed
                timed(graphs, "stage", "graphs.stage (one copy)")
                timed(graphs, "replay_staged", "graphs.replay_staged")
            timed(graphs.graphs[1], "replay", "graph.replay")
        timed(runner.model, "compute_logits", "compute_logits")
        timed(engine, "sampler", "sampler")
        timed(engine, "_update", "engine._update (waits + accept)")
        timed(engine.scheduler, "schedule", "scheduler.schedule")
        from hearth_llm.engine.sampling_params import SamplingParams

        engine.add_request(list(range(100, 132)), SamplingParams(temperature=0, max_tokens=2 * num_steps + 8,
                                                                ignore_eos=True, detokenize=False))
        for _ in range(4):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        spent.clear()
        started = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = time.perf_counter() - started
        for owner, name, original, was_own in reversed(patched):
            if was_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        say(f"host {shape}: {wall * 1e3 / num_steps:.3f} ms/step over {num_steps} steps; host us per step:")
        for label, seconds in sorted(spent.items(), key=lambda item: -item[1]):
            say(f"  {seconds * 1e6 / num_steps:8.1f} us  {label}")
        results[f"{shape}.host.us_per_step"] = {label: seconds * 1e6 / num_steps for label, seconds in spent.items()}
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(num_steps):
            engine.step()
        profiler.disable()
        summary = io.StringIO()
        pstats.Stats(profiler, stream=summary).sort_stats("tottime").print_stats(30)
        for line in summary.getvalue().splitlines()[6:40]:
            if line.strip():
                say("  " + line[:150])
        while engine.has_unfinished_requests():
            engine.step()
        del engine
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["check", "attention", "engine", "sweep", "flash"],
                        choices=["check", "attention", "sweep", "engine", "flash", "host"])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama3-8b"])
    parser.add_argument("--variants", nargs="+", default=VARIANTS,
                        help="engine variants (see VARIANTS); SHAPE:VARIANT runs on that shape only")
    parser.add_argument("--budget-s", type=float, default=80.0, help="stop starting new measurements after this")
    parser.add_argument("--sweep-budget-s", type=float, default=None, help="when the sweep stops (default: budget)")
    parser.add_argument("--host-shapes", nargs="+", default=None, help="shapes of part 'host' (default: --shapes)")
    parser.add_argument("--quick-sweep", action="store_true", help="a few launches per projection (QUICK_LAUNCHES)")
    parser.add_argument("--sweep-shapes", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    parser.add_argument("--sweep-set", choices=["unfused-pairs", "decode"], default="unfused-pairs",
                        help="decode: the projections as the default decode path runs them (DECODE_PROJECTIONS)")
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
        results["sweep"] = sweep(triton_gemv, triton_norm, triton_activation, min(sweep_end, budget_end),
                                 args.quick_sweep, args.sweep_shapes,
                                 DECODE_PROJECTIONS if args.sweep_set == "decode" else None)
    elif part == "host":
        host_part(args.host_shapes or args.shapes, results)
    else:
        engine_part(args.shapes, args.variants, budget_end, results)


if __name__ == "__main__":
    main()
