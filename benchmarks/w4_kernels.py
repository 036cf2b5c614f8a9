"""GPU benchmark of the w4a16 (AWQ/GPTQ) kernels of ``kernels/quant/triton_w4.py`` at Llama-3-8B
layer shapes, against bf16 cuBLAS and the old ``W4G128`` row kernel, and the engine's bs1 decode.

Timings as ``quant_kernels.py`` takes them: one CUDA graph of calls cycling through enough weight
copies to exceed the L2 cache, divided by the number of calls. GB/s counts the weight's bytes.

    python -m hearth_llm.benchmarks.w4_kernels --part check              # PASS/FAIL against the reference
    python -m hearth_llm.benchmarks.w4_kernels --part kernels --rows 1 4 8
    python -m hearth_llm.benchmarks.w4_kernels --part engine --methods awq bf16   # bs1 ms/token, same run
    python -m hearth_llm.benchmarks.w4_kernels --part compile --configs 0-3     # Triton cache warm-up only
    python -m hearth_llm.benchmarks.w4_kernels --part fused      # RMSNorm / SwiGLU fused into the one-row kernel
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
WORKING_SET = 256 << 20

# (kernel, config, programs split-K aims for) the kernel part times: GEMVs at one row, tensor-core
# GEMVs at every row count. Index 22 and 7 are triton_w4's defaults (GEMV_CONFIGS, DOT_CONFIGS); 0 is 22 without PDL.
def _gemv(block_n, num_warps, groups_per_iter, prefetch, target, pdl=False):
    return ("gemv", dict(block_n=block_n, num_warps=num_warps, num_stages=1, groups_per_iter=groups_per_iter,
                         prefetch=prefetch, pdl=pdl), target)


def _dot(block_n, num_warps, num_stages, asm_decode, target, groups_per_iter=1):
    return ("dot", dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, groups_per_iter=groups_per_iter,
                        asm_decode=asm_decode), target)


def _row(block_n, num_warps, groups_per_iter, target, pdl=True):
    return ("row", dict(block_n=block_n, num_warps=num_warps, num_stages=1, groups_per_iter=groups_per_iter,
                        pdl=pdl), target)


CONFIGS = [
    _gemv(64, 4, 2, True, 528), _gemv(64, 4, 1, True, 528), _gemv(64, 4, 2, True, 1056), _gemv(32, 4, 2, True, 1056),
    _gemv(128, 8, 2, True, 528), _gemv(128, 4, 2, False, 264), _gemv(64, 4, 2, True, 264),
    _dot(128, 4, 3, False, 264), _dot(128, 4, 3, True, 264), _dot(64, 4, 4, True, 264), _dot(128, 4, 4, True, 528),
    _dot(128, 4, 3, False, 528), _dot(64, 4, 3, True, 528, groups_per_iter=2),
    # 13..: the whole-K one-row kernel (triton_w4.row_gemv), PDL unless marked
    _row(8, 4, 16, 0), _row(8, 4, 8, 0), _row(4, 4, 16, 0), _row(16, 4, 8, 0), _row(8, 4, 16, 1056),
    _row(8, 2, 16, 0), _row(8, 4, 16, 0, pdl=False), _row(4, 2, 16, 0), _row(16, 8, 16, 0),
    # 22..: the split GEMV (index 0's kernel) with programmatic dependent launch
    _gemv(64, 4, 2, True, 528, pdl=True), _gemv(64, 4, 2, True, 1056, pdl=True), _gemv(32, 2, 2, True, 1056, pdl=True),
    _gemv(64, 4, 2, True, 0, pdl=True),
]


def label(kind: str, config: dict, target: int) -> str:
    return (f"{kind} BN{config['block_n']}/W{config['num_warps']}/st{config['num_stages']}/G{config['groups_per_iter']}"
            f"/P{target}" + ("/asm" if config.get("asm_decode") else "") + ("/pf" if config.get("prefetch") else "")
            + ("/pdl" if config.get("pdl") else ""))


def random_w4(n: int, k: int, device="cuda"):
    """A random :class:`W4Weight`: random code words, fp16 scales in [0.001, 0.011), zeros 0..15."""
    from hearth_llm.kernels.quant.w4_layout import W4Weight

    codes = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device)
    scales = (torch.rand(k // 128, n, device=device) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (k // 128, n), dtype=torch.int32, device=device)
    headers = scales.view(torch.int16).to(torch.int32) & 0xFFFF | (zeros << 16)
    return W4Weight(codes, headers)


def copies_of(weight, nbytes: int):
    from hearth_llm.kernels.quant.w4_layout import W4Weight

    count = max(2, min(64, -(-WORKING_SET // nbytes)))
    return [weight] + [W4Weight(weight.codes.clone(), weight.headers.clone()) for _ in range(count - 1)]


def call_for(kind: str, config: dict, target: int, x, bias=None):
    from hearth_llm.kernels.quant import triton_w4

    def call(weight):
        tiles = -(-weight.out_features // config["block_n"])
        split = 1 if target == 0 else triton_w4.split_for(tiles, weight.in_features // 128, target)
        fn = {"gemv": triton_w4.gemv, "row": triton_w4.row_gemv}.get(kind, triton_w4.dot_gemv)
        return fn(x, weight, bias, split_k=split, **config)
    return call


def part_check() -> bool:
    """Every path (each GEMV split and unsplit) against the dequantized float32 reference, bf16 x;
    the layout conversions exact."""
    from hearth_llm.kernels.quant import gguf_reference, triton_w4, w4_layout

    ok = True
    torch.manual_seed(0)
    for n, k in ((256, 512), (6144, 4096), (4096, 14336)):
        weight = random_w4(n, k)
        dense = w4_layout.dequantize(weight)
        rows = w4_layout.to_rows(weight)
        exact = torch.equal(triton_w4.dequantize(weight, torch.float32), dense) and \
            torch.equal(w4_layout.from_rows(rows).codes, weight.codes) and \
            torch.equal(gguf_reference.dequantize(rows, "W4G128"), dense)
        print(f"{'PASS' if exact else 'FAIL'} W4 layout/dequantize exact {n}x{k}", flush=True)
        ok &= exact
        for m in (1, 4, 8, 16, 40):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = F.linear(x.float(), dense)
            cases = [("default", lambda: triton_w4.w4_linear(x, weight))]
            if m in (1, 4):
                cases += [(f"gemv S{s}", lambda s=s: triton_w4.gemv(x, weight, split_k=s)) for s in (1, 3)]
                if m == 1:
                    cases += [(f"gemv noPF S{s}", lambda s=s: triton_w4.gemv(x, weight, split_k=s, prefetch=False))
                              for s in (1, 3)]
            if m <= 16:
                cases += [(f"dot S{s}", lambda s=s: triton_w4.dot_gemv(x, weight, split_k=s)) for s in (1, 3)]
                cases += [(f"dot/asm S{s}", lambda s=s: triton_w4.dot_gemv(x, weight, split_k=s, asm_decode=True))
                          for s in (1, 3)]
            for name, fn in cases:
                try:
                    for _ in range(2):  # the second call sees the workspace the first left
                        out = fn().float()
                    err = ((out - expected).abs().max() / expected.abs().max()).item()
                except Exception as error:  # noqa: BLE001
                    print(f"FAIL W4 {name} M={m} {n}x{k}: {type(error).__name__}: {error}"[:400], flush=True)
                    ok = False
                    continue
                good = err < 1e-2
                ok &= good
                print(f"{'PASS' if good else 'FAIL'} W4 {name} M={m} {n}x{k}: max rel err {err:.2e}", flush=True)
    return ok


def part_kernels(rows, config_ids, json_path=None, tuned_path=None) -> dict:
    """Each row count over the four shapes (the layer sum printed after each, and the results
    written to ``json_path`` so far, so a time limit keeps what ran). ``tuned_path``: the best
    configs of this run as ``triton_w4`` settings (:func:`tuned_settings`), for ``--part engine``."""
    from hearth_llm.benchmarks import timing
    from hearth_llm.kernels.quant import triton_w4, triton_w4g128, w4_layout

    results: dict = {}
    weights, dense, old_rows = {}, {}, {}
    for name, (n, k) in SHAPES.items():
        weights[name] = copies_of(random_w4(n, k), n * k // 2)
        dense[name] = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                       for _ in range(max(2, min(64, -(-WORKING_SET // (n * k * 2)))))]
    for m in rows:
        totals: dict = {}
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = F.linear(x.float(), w4_layout.dequantize(weights[name][0]))
            cells = {"bf16": timing.graphed_us([lambda w=w: F.linear(x, w) for w in dense[name]], num_warmup=2)}
            if m == 1:
                copies = weights[name]
                old_rows[name] = [w4_layout.to_rows(w) for w in copies[:8]] * (len(copies) // 8 or 1)
                cells["old W4G128"] = timing.graphed_us(
                    [lambda d=d: triton_w4g128.w4g128_linear(x, d) for d in old_rows.pop(name)], num_warmup=2)
            for index in config_ids:
                kind, config, target = CONFIGS[index]
                if kind in ("gemv", "row") and m > 1:
                    continue
                try:
                    call = call_for(kind, config, target, x)
                    err = ((call(weights[name][0]).float() - expected).abs().max() / expected.abs().max()).item()
                    if not err < 1e-2:  # a wrong kernel is never timed, so never picked
                        print(f"W4 {label(kind, config, target)} M={m} {name}: WRONG, max rel err {err:.2e}", flush=True)
                        continue
                    cells[label(kind, config, target)] = timing.graphed_us(
                        [lambda w=w: call(w) for w in weights[name]], num_warmup=2)
                except Exception as error:  # noqa: BLE001 - one config failing must not hide the rest
                    print(f"W4 {label(kind, config, target)} M={m} {name}: {type(error).__name__}: {error}"[:400],
                          flush=True)
            cells["w4 default"] = timing.graphed_us([lambda w=w: triton_w4.w4_linear(x, w) for w in weights[name]],
                                                    num_warmup=2)
            for key, us in cells.items():
                totals[key] = totals.get(key, 0.0) + us
            nbytes = {key: n * k * 2 if key == "bf16" else n * k // 2 + n * k // 32 for key in cells}
            print(f"W4 M={m:<2} {name:7} " + " | ".join(f"{key} {us:.1f} us ({nbytes[key] / us / 1e3:.0f} GB/s)"
                                                        for key, us in cells.items()), flush=True)
            results[f"{name} M={m}"] = cells
        line = {key: round(us, 1) for key, us in totals.items()}
        best = min((us, key) for key, us in line.items() if key not in ("bf16", "old W4G128"))
        print(f"W4 layer sum M={m}: " + " | ".join(f"{key} {us}" for key, us in line.items())
              + f" || best {best[1]} {best[0]:.1f} vs bf16 {line['bf16']} ({best[0] / line['bf16']:.2f}x)", flush=True)
        results[f"layer sum M={m}"] = line
        if json_path:
            with open(json_path, "w") as sink:
                json.dump(results, sink, indent=2)
        if tuned_path:
            settings = tuned_settings(results, config_ids)
            with open(tuned_path, "w") as sink:
                json.dump(settings, sink, indent=2)
            print(f"W4 tuned so far: {json.dumps(settings)}", flush=True)
    return results


def part_fused(json_path=None) -> dict:
    """One row, µs per call in CUDA graphs (weights cycling past L2): the unfused ops (``kernels``'
    RMSNorm / SwiGLU, then the default one-row path ``w4_linear``) against the fused one-row kernels, and the fused
    result's max relative error against the unfused one (bf16: the fused norm is one pass)."""
    from hearth_llm import kernels
    from hearth_llm.benchmarks import timing
    from hearth_llm.kernels.quant import triton_w4

    results = {}
    eps = 1e-5
    for name in ("qkv", "gate_up", "down"):
        n, k = SHAPES[name]
        copies = copies_of(random_w4(n, k), n * k // 2)
        x = torch.randn(1, 2 * k if name == "down" else k, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        norm_weight = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        if name == "down":
            pairs = {"silu prologue": (lambda w: triton_w4.w4_linear(kernels.silu_and_mul(x), w),
                                       lambda w: triton_w4.silu_and_mul_linear(x, w))}
        else:
            def unfused(w):
                return triton_w4.w4_linear(kernels.rms_norm(x, norm_weight, eps, residual)[0], w)
            pairs = {"rms prologue": (unfused, lambda w: triton_w4.rms_norm_linear(x, residual, norm_weight, eps, w)[0])}
            if name == "gate_up":
                pairs["rms + swiglu epilogue"] = (
                    lambda w: kernels.silu_and_mul(unfused(w)),
                    lambda w: triton_w4.rms_norm_linear_silu_and_mul(x, residual, norm_weight, eps, w)[0])
        for label_, (plain, fused) in pairs.items():
            try:
                expected, got = plain(copies[0]).float(), fused(copies[0]).float()
                err = ((got - expected).abs().max() / expected.abs().max()).item()
                cells = {"unfused": timing.graphed_us([lambda w=w: plain(w) for w in copies], num_warmup=2),
                         "fused": timing.graphed_us([lambda w=w: fused(w) for w in copies], num_warmup=2),
                         "max_rel_err": err}
            except Exception as error:  # noqa: BLE001 - the other shapes still run
                print(f"W4 fused {name} {label_}: {type(error).__name__}: {error}"[:400], flush=True)
                continue
            results[f"{name} {label_}"] = cells
            print(f"W4 fused {name} {label_}: unfused {cells['unfused']:.1f} us | fused {cells['fused']:.1f} us | "
                  f"max rel err {err:.2e}", flush=True)
            if json_path:
                with open(json_path, "w") as sink:
                    json.dump(results, sink, indent=2)
    return results


def tuned_settings(results: dict, config_ids) -> dict:
    """``triton_w4`` settings from the timings so far: at one row the GEMV or the tensor-core kernel
    (whichever kind's best configs sum lower over the layers), each width class's fastest config of
    each kind (narrow: every shape but gate_up), the tensor-core ones by their sum over 2+ rows."""
    from hearth_llm.kernels.quant import triton_w4

    def class_of(name):
        return triton_w4.width_class(SHAPES[name][0])

    def best(kind, row_counts):
        picks = {}
        for width in ("narrow", "wide"):
            sums = {}
            for index in config_ids:
                if CONFIGS[index][0] != kind:
                    continue
                key = label(*CONFIGS[index])
                cells = [results.get(f"{name} M={m}", {}).get(key) for name in SHAPES if class_of(name) == width
                         for m in row_counts if f"{name} M={m}" in results]
                if cells and None not in cells:
                    sums[index] = sum(cells)
            if sums:
                index = min(sums, key=sums.get)
                picks[width] = (index, sums[index])
        return picks

    settings = {}
    gemv_1, dot_1 = best("gemv", [1]), best("dot", [1])
    dot_many = best("dot", [m for m in (2, 4, 8, 16) if any(k.endswith(f"M={m}") for k in results)]) or dot_1
    for width, (index, _) in gemv_1.items():
        settings.setdefault("GEMV_CONFIGS", {})[width] = {**CONFIGS[index][1], "target_programs": CONFIGS[index][2]}
    for width, (index, _) in dot_many.items():
        settings.setdefault("DOT_CONFIGS", {})[width] = {**CONFIGS[index][1], "target_programs": CONFIGS[index][2]}
    if gemv_1 and dot_1:
        settings["GEMV_MAX_ROWS"] = int(sum(v for _, v in gemv_1.values()) <= sum(v for _, v in dot_1.values()))
        if not settings["GEMV_MAX_ROWS"]:  # one row takes the tensor-core kernel: its one-row best
            for width, (index, _) in dot_1.items():
                settings["DOT_CONFIGS"][width] = {**CONFIGS[index][1], "target_programs": CONFIGS[index][2]}
    return settings


def apply_settings(settings: dict) -> None:
    """Set ``triton_w4``'s module settings (``GEMV_MAX_ROWS``, ``GEMV_CONFIGS``, ``DOT_CONFIGS``)."""
    from hearth_llm.kernels.quant import triton_w4

    if "GEMV_MAX_ROWS" in settings:
        triton_w4.GEMV_MAX_ROWS = settings["GEMV_MAX_ROWS"]
    for name in ("GEMV_CONFIGS", "DOT_CONFIGS"):
        for width, config in settings.get(name, {}).items():
            getattr(triton_w4, name)[width] = {**getattr(triton_w4, name)[width], **config}


def part_compile(config_ids) -> None:
    """Compile the kernels the other parts run (Triton's disk cache keeps them) on a small weight of
    the same specialization: each config split and unsplit (the GEMVs at 1 row, config 0 also at
    4; the tensor-core GEMV compiles once for 1..16 rows), the dequantizer and the old kernel."""
    from hearth_llm.kernels.quant import triton_w4

    weight = random_w4(512, 1024)
    for index in config_ids:
        kind, config, target = CONFIGS[index]
        for m in (1, 4) if index == 0 else (1,) if kind in ("gemv", "row") else (4,):
            x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
            for split_target in (0, 10**6):
                try:
                    call_for(kind, config, split_target, x)(weight)
                except Exception as error:  # noqa: BLE001
                    print(f"compile {label(kind, config, target)} M={m}: {type(error).__name__}: {error}"[:300])
    if 0 in config_ids:
        triton_w4.dequantize(weight, torch.bfloat16)
        x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
        for split_target in (0, 10**6):  # the check's GEMV without prefetch
            call_for("gemv", {**CONFIGS[0][1], "prefetch": False}, split_target, x)(weight)
    if 5 in config_ids:  # the old W4G128 kernel at one row: its narrow (<= 4096 rows) and wide configs
        from hearth_llm.kernels.quant import triton_w4g128, w4_layout

        x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
        for num_rows in (512, 4352):
            triton_w4g128.w4g128_linear(x, w4_layout.to_rows(random_w4(num_rows, 1024)))
    torch.cuda.synchronize()


def _bs1(engine) -> dict:
    from hearth_llm.benchmarks.throughput import decode_graph_bs1_ms, ours_bs1_ms_per_token

    graphs = engine.runner.decode_graphs
    ms = min(ours_bs1_ms_per_token(engine, num_tokens=128) for _ in range(2))
    return {"bs1_ms_per_token": ms, "decode_graph_ms": decode_graph_bs1_ms(engine),
            "graph_replays": None if graphs is None else graphs.num_replays}


# --part engine --variants: triton_w4 module flags set before the AWQ engine's graphs are captured again.
# ("pdl": the split GEMV's programmatic dependent launch, GEMV_CONFIGS[*]["pdl"])
VARIANTS = {
    "gemv": {"ROW_GEMV": False, "FUSED_ROW": False, "pdl": True},
    "gemv-nopdl": {"ROW_GEMV": False, "FUSED_ROW": False, "pdl": False},
    "gemv+fused": {"ROW_GEMV": False, "FUSED_ROW": True, "pdl": True},
    "row": {"ROW_GEMV": True, "FUSED_ROW": False, "pdl": True},
    "row+fused": {"ROW_GEMV": True, "FUSED_ROW": True, "pdl": True},
    "row+fused-noepi": {"ROW_GEMV": True, "FUSED_ROW": True, "SWIGLU_EPILOGUE": False, "pdl": True},
}


def _recapture(engine, max_num_seqs: int) -> None:
    import gc

    engine.runner.decode_graphs = None
    gc.collect()
    engine.runner.enable_cuda_graphs(min(max_num_seqs, 512), engine.max_model_len)


def part_engine(methods, num_layers, max_num_seqs: int, tuned_path=None, variants=()) -> dict:
    """bs1 ms/token of the engine on the Llama-3-8B shape with random weights (``quant_engine``'s
    checkpoints: AWQ GEMM parts for ``awq``), one engine at a time, with the decode graphs' replays.
    ``tuned_path`` (``--part kernels --tuned``): the AWQ engine is measured again with those
    settings, its graphs captured anew ("awq tuned")."""
    import gc

    from hearth_llm.benchmarks import quant_engine

    results = {}
    for method in methods:
        args = argparse.Namespace(shape="llama3-8b", method=method, device="cuda", num_layers=num_layers,
                                  max_model_len=4096, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                                  kv_cache_memory="8GiB", kv_cache_dtype="auto")
        started = time.perf_counter()
        engine = quant_engine.build_engine(args)
        results[method] = {**_bs1(engine), "init_s": time.perf_counter() - started}
        print(f"W4 engine {method} 8B ({num_layers or 32} layers): {json.dumps(results[method])}", flush=True)
        if method == "awq" and variants:
            from hearth_llm.kernels.quant import triton_w4

            saved = {name: getattr(triton_w4, name) for name in ("ROW_GEMV", "FUSED_ROW", "SWIGLU_EPILOGUE")}
            saved["pdl"] = triton_w4.GEMV_CONFIGS["narrow"]["pdl"]
            for variant in variants:
                try:
                    for name, value in {**saved, **VARIANTS[variant]}.items():
                        if name == "pdl":
                            for config in triton_w4.GEMV_CONFIGS.values():
                                config["pdl"] = value
                        else:
                            setattr(triton_w4, name, value)
                    _recapture(engine, max_num_seqs)
                    results[f"awq {variant}"] = _bs1(engine)
                    print(f"W4 engine awq {variant} 8B: {json.dumps(results[f'awq {variant}'])}", flush=True)
                except Exception as error:  # noqa: BLE001 - the other variants still run
                    print(f"W4 engine awq {variant}: {type(error).__name__}: {error}"[:600], flush=True)
            for name, value in saved.items():
                if name == "pdl":
                    for config in triton_w4.GEMV_CONFIGS.values():
                        config["pdl"] = value
                else:
                    setattr(triton_w4, name, value)
        if method == "awq" and tuned_path:
            try:
                with open(tuned_path) as source:
                    settings = json.load(source)
                apply_settings(settings)
                engine.runner.decode_graphs = None
                gc.collect()
                engine.runner.enable_cuda_graphs(min(max_num_seqs, 512), engine.max_model_len)
                results["awq tuned"] = {**_bs1(engine), "settings": settings}
                print(f"W4 engine awq tuned 8B: {json.dumps(results['awq tuned'])}", flush=True)
            except Exception as error:  # noqa: BLE001 - the default number above stands
                print(f"W4 engine awq tuned: {type(error).__name__}: {error}"[:400], flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    for name in ["awq", "awq tuned"] + [f"awq {v}" for v in variants]:
        if name in results and "bf16" in results:
            ratio = results[name]["bs1_ms_per_token"] / results["bf16"]["bs1_ms_per_token"]
            results[f"{name} / bf16"] = ratio
            print(f"W4 engine bs1 {name} / bf16 = {ratio:.3f} (goal <= 0.45)", flush=True)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("check", "kernels", "engine", "compile", "fused"), required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--configs", default=f"0-{len(CONFIGS) - 1}", help="indices into CONFIGS, e.g. 0-3,6")
    parser.add_argument("--methods", nargs="+", default=["awq"], choices=("awq", "bf16", "fp8"))
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                        help="engine: AWQ bs1 again with these triton_w4 settings (graphs captured anew)")
    parser.add_argument("--tuned", help="kernels: write the best settings here; engine: measure AWQ again with them")
    args = parser.parse_args(argv)
    config_ids = []
    for part in args.configs.split(","):
        low, _, high = part.partition("-")
        config_ids += list(range(int(low), int(high or low) + 1))
    if args.part == "check":
        results = {"ok": part_check()}
    elif args.part == "kernels":
        results = part_kernels(args.rows, config_ids, args.json, args.tuned)
    elif args.part == "fused":
        results = part_fused(args.json)
    elif args.part == "compile":
        part_compile(config_ids)
        return
    else:
        results = part_engine(args.methods, args.num_layers, args.max_num_seqs, args.tuned, args.variants)
    if args.json:
        with open(args.json, "w") as sink:
            json.dump(results, sink, indent=2)


if __name__ == "__main__":
    main()
