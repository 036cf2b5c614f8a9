"""GPU micro-benchmark of the issue-16 linear kernels at Llama-3-8B layer shapes, against bf16 cuBLAS.

Each timing is one CUDA graph of calls that cycle through enough copies of the weight to exceed the
L2 cache (a decode step reads every layer's weight once, so a single weight replayed from L2 would
flatter the small layers), divided by the number of calls. GB/s counts the weight's bytes only.

    python -m hearth_llm.benchmarks.quant_kernels --part w4 --rows 1 4 16
    python -m hearth_llm.benchmarks.quant_kernels --part fp8 --rows 1 4
    python -m hearth_llm.benchmarks.quant_kernels --part check     # GPU correctness, PASS/FAIL lines
    python -m hearth_llm.benchmarks.quant_kernels --part fp8-row   # one-row FP8 GEMV: launch sweep, fused prologues
    python -m hearth_llm.benchmarks.quant_kernels --part check-fp8-row
    python -m hearth_llm.benchmarks.quant_kernels --part fp8-round --rows 32 --limit-s 30  # the three in one
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from . import timing

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
WORKING_SET = 256 << 20  # bytes of weight copies per timing: well above the H200's 50 MiB L2


def graphed_us(calls) -> float:
    """Microseconds per call (:func:`.timing.graphed_us`); the calls differ only in their weight
    copy, so two warm-up calls compile and pick everything."""
    return timing.graphed_us(calls, num_warmup=2)


def copies_for(nbytes: int) -> int:
    return max(2, min(64, math.ceil(WORKING_SET / nbytes)))


def w4_data(n: int, k: int, copies: int) -> list[torch.Tensor]:
    """Random ``W4G128`` rows built on the GPU: random code bytes, then each group's 4-byte header
    (float16 scale, zero point 0..15, a pad byte) written over its first bytes."""
    groups = torch.randint(0, 256, (n, k // 128, 68), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // 128, device="cuda") * 0.01 + 0.001).half()
    groups[..., 0:2] = scales.reshape(-1).view(torch.uint8).reshape(n, k // 128, 2)
    groups[..., 2] = torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, device="cuda")
    groups[..., 3] = 0
    data = groups.reshape(n, -1)
    return [data] + [data.clone() for _ in range(copies - 1)]


def bf16_us(n: int, k: int, m: int) -> float:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return graphed_us([lambda w=w: F.linear(x, w) for w in weights])


def bench_w4(rows, configs) -> None:
    from hearth_llm.kernels.quant import triton_w4g128

    totals: dict = {}
    for name, (n, k) in SHAPES.items():
        datas = w4_data(n, k, copies_for(n * k // 2))
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = bf16_us(n, k, m)
            cells = [f"bf16 {base:.1f} us ({n * k * 2 / base / 1e3:.0f} GB/s)"]
            totals[(m, "bf16")] = totals.get((m, "bf16"), 0) + base
            for config in (configs if m == 1 else configs[:2] if m <= 8 else [None]):
                if config is None:
                    fn, label = (lambda d: triton_w4g128.w4g128_linear(x, d, gemv_max_rows=0)), "dequant+cuBLAS"
                else:
                    bn, gpi, warps, split, prefetch, j4 = (tuple(config) + (1, 1))[:6]
                    fn = (lambda d, c=(bn, gpi, warps, split, prefetch, j4): triton_w4g128.w4g128_linear(
                        x, d, gemv_max_rows=64, block_n=c[0], groups_per_iter=c[1], num_warps=c[2], split_k=c[3],
                        prefetch=bool(c[4]), variant="j4" if c[5] else "v1"))
                    label = (f"{'j4' if j4 else 'v1'} BN{bn}/G{gpi}/W{warps}/S{split}"
                             + ("" if prefetch or j4 else "/noPF"))
                us = graphed_us([lambda d=d: fn(d) for d in datas])
                totals[(m, label)] = totals.get((m, label), 0) + us
                cells.append(f"{label} {us:.1f} us ({datas[0].numel() / us / 1e3:.0f} GB/s)")
            print(f"W4 M={m:<3} {name:7} " + " | ".join(cells), flush=True)
    for m in rows:
        print(f"W4 layer sum M={m}: " + " | ".join(f"{label} {v:.1f} us" for (mm, label), v in totals.items()
                                                   if mm == m), flush=True)


def bench_fp8(rows, configs) -> None:
    from hearth_llm.kernels.quant import fp8, triton_fp8

    totals: dict = {}
    for name, (n, k) in SHAPES.items():
        wq, ws = fp8.quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
        copies = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies_for(n * k) - 1)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = bf16_us(n, k, m)
            results = {"bf16": base}
            results["quant+scaled_mm"] = graphed_us(
                [lambda c=c: triton_fp8.fp8_linear(
                    x, c[0], c[1], gemv_max_rows=0, dot_max_rows=0, codes_gemm_max_rows=0)
                 for c in copies])
            if triton_fp8.DOT_MAX_ROWS < m <= 128:  # the codes GEMM (off by default) against _scaled_mm
                results["quant+codes gemm"] = graphed_us([lambda c=c: triton_fp8.codes_gemm(
                    *triton_fp8.quantize_rows(x), c[0], c[1]) for c in copies])
            if m > 16:  # the quantizer's old IEEE division per element, for the A/B
                triton_fp8.QUANTIZE_RECIP = False
                results["quant(div)+scaled_mm"] = graphed_us(
                    [lambda c=c: triton_fp8.fp8_linear(
                    x, c[0], c[1], gemv_max_rows=0, dot_max_rows=0, codes_gemm_max_rows=0)
                 for c in copies])
                triton_fp8.QUANTIZE_RECIP = True
            if m <= triton_fp8.DOT_MAX_ROWS:
                results["default"] = graphed_us([lambda c=c: triton_fp8.fp8_linear(x, c[0], c[1]) for c in copies])
            if m == 1:
                results["old gemv"] = graphed_us(
                    [lambda c=c: triton_fp8.fp8_linear(x, c[0], c[1], gemv_max_rows=1, dot_max_rows=0) for c in copies])
            if m <= 16:
                for kind, config in (configs if m == 1 else configs[:2]):
                    bn, bk, warps, stages, recip, split = (tuple(config) + (1,))[:6]
                    label = (f"dot BN{bn}/K{bk}/W{warps}/st{stages}" + ("/recip" if recip else "/div")
                             + (f"/S{split}" if split > 1 else ""))
                    fn = (lambda c, cfg=(bn, bk, warps, stages, recip, split): triton_fp8.dot_gemv(
                        x, c[0], c[1], block_n=cfg[0], block_k=cfg[1], num_warps=cfg[2], num_stages=cfg[3],
                        recip=bool(cfg[4]), split_k=cfg[5]))
                    results[label] = graphed_us([lambda c=c, fn=fn: fn(c) for c in copies])
            for label, us in results.items():
                totals[(m, label)] = totals.get((m, label), 0) + us
            print(f"FP8 M={m:<3} {name:7} " + " | ".join(
                f"{label} {us:.1f} us ({n * k * (2 if label == 'bf16' else 1) / us / 1e3:.0f} GB/s)"
                for label, us in results.items()), flush=True)
    for m in rows:
        print(f"FP8 layer sum M={m}: " + " | ".join(f"{label} {v:.1f} us" for (mm, label), v in totals.items()
                                                    if mm == m), flush=True)


# One-row GEMV launches the sweep tries per shape (BN, BK, WARPS, STAGES, SPLIT[, PREFETCH]): the
# table's entry first, then the likeliest alternative, then the rest (tile depth, split, stages;
# 256-column tiles of 4 stages fit two programs an SM, 512-column ones of 3 stages one; qkv's
# "/0" is its table entry without the row's prefetch).
ROW_SWEEP = {
    "qkv": [(64, 512, 4, 3, 2), (64, 256, 4, 4, 2), (64, 512, 4, 3, 2, 0), (64, 256, 4, 4, 4), (64, 512, 4, 3, 4)],
    "o": [(64, 512, 4, 3, 2), (64, 256, 4, 4, 4), (64, 256, 4, 4, 2), (64, 512, 4, 3, 4)],
    "gate_up": [(64, 256, 4, 4, 1), (64, 128, 4, 6, 1), (64, 512, 4, 3, 1), (128, 128, 8, 4, 1), (64, 256, 4, 4, 2)],
    "down": [(64, 512, 4, 3, 4), (64, 256, 4, 4, 4), (64, 256, 4, 4, 2), (64, 512, 4, 3, 2), (64, 256, 4, 4, 8)],
}
PROLOGUE_OF = {"qkv": "rms_norm", "gate_up": "rms_norm", "down": "silu", "o": None}


def bench_row(limit_s: float = 1e9, with_old: bool = False) -> dict:
    """M=1: bf16 cuBLAS and the one-row GEMV at each :data:`ROW_SWEEP` launch, shapes in turn (every
    shape's first two launches first, the rest while ``limit_s`` lasts), then at each shape's best
    launch its fused prologue against the unfused op + plain GEMV (and, ``with_old``, the several-row
    GEMV that ran one-row steps before). Each timing prints as it lands. Returns {shape: best launch}."""
    import time

    from hearth_llm import kernels
    from hearth_llm.kernels.quant import fp8, triton_fp8

    started = time.perf_counter()
    data, results = {}, {}
    for name, (n, k) in SHAPES.items():
        wq, ws = fp8.quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
        data[name] = ([(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies_for(n * k) - 1)],
                      torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
        results[name] = {"bf16": bf16_us(n, k, 1)}

    def timed(name: str, label: str, fn) -> None:
        n, k = SHAPES[name]
        try:
            us = results[name][label] = graphed_us([lambda c=c: fn(c) for c in data[name][0]])
        except Exception as error:  # e.g. a launch past the shared memory: the sweep goes on
            print(f"FP8 row M=1 {name:7} {label}: FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
            return
        print(f"FP8 row M=1 {name:7} {label}: {us:.1f} us ({n * k / us / 1e3:.0f} GB/s; bf16 cuBLAS "
              f"{results[name]['bf16']:.1f} us)", flush=True)

    for turn in range(max(len(configs) for configs in ROW_SWEEP.values())):
        for name, configs in ROW_SWEEP.items():
            if turn >= len(configs) or (turn >= 2 and time.perf_counter() - started > limit_s):
                continue
            launch = triton_fp8.RowLaunch(*configs[turn])
            x = data[name][1]
            timed(name, "row " + "/".join(map(str, configs[turn])),
                  lambda c, x=x, launch=launch: triton_fp8.row_gemv(x, c[0], c[1], launch=launch))
    best = {}
    for name in SHAPES:
        labels = [label for label in results[name] if label.startswith("row ")]
        if not labels:
            print(f"FP8 row M=1 {name}: no launch ran", flush=True)
            return best
        best[name] = tuple(int(v) for v in min(labels, key=results[name].get)[4:].split("/"))
    print("FP8 row best launches: " + repr(best) + " | layer sum " + " | ".join(
        f"{what} {sum(results[name][label] for name, label in labels.items()):.1f} us" for what, labels in (
            ("bf16", {name: "bf16" for name in SHAPES}),
            ("row best", {name: "row " + "/".join(map(str, best[name])) for name in SHAPES}))), flush=True)
    for name, (n, k) in SHAPES.items():
        launch, x = triton_fp8.RowLaunch(*best[name]), data[name][1]
        if PROLOGUE_OF[name] == "rms_norm":
            residual = torch.randn_like(x)
            norm_weight = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
            timed(name, "fused rms_norm", lambda c, x=x, r=residual, w=norm_weight, launch=launch: triton_fp8.row_gemv(
                x, c[0], c[1], prologue=triton_fp8.RMS_NORM, residual=r, norm_weight=w, eps=1e-5, launch=launch))
            timed(name, "rms_norm + row", lambda c, x=x, r=residual, w=norm_weight, launch=launch: triton_fp8.row_gemv(
                kernels.rms_norm(x, w, 1e-5, r)[0], c[0], c[1], launch=launch))
        elif PROLOGUE_OF[name] == "silu":
            gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
            timed(name, "fused silu", lambda c, g=gate_up, launch=launch: triton_fp8.row_gemv(
                g, c[0], c[1], prologue=triton_fp8.SILU_AND_MUL, launch=launch))
            timed(name, "silu + row", lambda c, g=gate_up, launch=launch: triton_fp8.row_gemv(
                kernels.silu_and_mul(g), c[0], c[1], launch=launch))
        if with_old:
            timed(name, "old dot", lambda c, x=x: triton_fp8.dot_gemv(x, c[0], c[1]))
    return best


def bench_small_m(rows=(32,), limit_s: float = 1e9) -> None:
    """Decode batches of a few dozen rows: the quantizer + ``_scaled_mm`` (today's path) against the
    quantizer + ``codes_gemm`` (off by default), per 8B layer shape; stops past ``limit_s``."""
    import time

    from hearth_llm.kernels.quant import fp8, triton_fp8

    started = time.perf_counter()
    totals: dict = {}
    for m in rows:
        for name, (n, k) in SHAPES.items():
            if time.perf_counter() - started > limit_s:
                return
            wq, ws = fp8.quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
            copies = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies_for(n * k) - 1)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            results = {"scaled_mm": graphed_us([lambda c=c: triton_fp8.fp8_linear(
                x, c[0], c[1], gemv_max_rows=0, dot_max_rows=0, codes_gemm_max_rows=0) for c in copies]),
                       "codes gemm": graphed_us([lambda c=c: triton_fp8.codes_gemm(
                           *triton_fp8.quantize_rows(x), c[0], c[1]) for c in copies])}
            for label, us in results.items():
                totals[(m, label)] = totals.get((m, label), 0.0) + us
            print(f"FP8 small-M M={m} {name:7} " + " | ".join(
                f"quant+{label} {us:.1f} us ({n * k / us / 1e3:.0f} GB/s)" for label, us in results.items()),
                flush=True)
        print(f"FP8 small-M M={m} layer sum: " + " | ".join(
            f"quant+{label} {v:.1f} us" for (mm, label), v in totals.items() if mm == m), flush=True)


def check_row(device: str = "cuda") -> bool:
    """The one-row FP8 GEMV on the GPU at the engine's launches (so its compiled kernels serve):
    plain (one case with a bias) against the exact product of the quantizer's codes, each call
    twice (the split buffers must come back clean), and the fused RMSNorm / SwiGLU prologues
    against that op's kernel followed by the plain GEMV; one PASS/FAIL line each. Every weight
    has subnormal e4m3 codes (columns of small values)."""
    from hearth_llm import kernels
    from hearth_llm.kernels.quant import fp8, triton_fp8

    ok = True

    def report(good: bool, what: str) -> None:
        nonlocal ok
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} fp8 row {what}", flush=True)

    cases = [((6144, 4096), None, "rms_norm"), ((1008, 14336), triton_fp8.RowLaunch(64, 512, 4, 3, 4), "silu"),
             ((28672, 4096), None, "rms_norm")]
    for (n, k), launch, prologue in cases:
        launch = launch or triton_fp8.row_launch(n, k)
        generator = torch.Generator(device).manual_seed(n)
        weight = torch.randn(n, k, device=device, generator=generator) * 0.02
        weight[:, :64] *= 1e-4  # subnormal e4m3 codes
        wq, ws = fp8.quantize_rows(weight)
        x = torch.randn(1, k, device=device, generator=generator).bfloat16()
        bias = torch.randn(n, device=device, generator=generator).bfloat16() if n == 6144 else None
        codes, xs = triton_fp8.quantize_rows(x)
        exact = (codes.float() @ wq.float().t()) * xs[:, None] * ws[None, :]
        exact = exact + bias.float() if bias is not None else exact
        for call in range(2):
            out, _ = triton_fp8.row_gemv(x, wq, ws, bias, launch=launch)
            err = ((out.float() - exact).abs().max() / exact.abs().max()).item()
            report(err <= 1e-2 and out.dtype == torch.bfloat16,
                   f"gemv N={n} K={k} {launch} bias={bias is not None} call {call + 1}: rel err {err:.2e}")
        if prologue == "rms_norm":
            residual = torch.randn_like(x)
            norm_weight = torch.rand(k, device=device, generator=generator).bfloat16() + 0.5
            normed, summed = kernels.rms_norm(x, norm_weight, 1e-5, residual)
            expected = triton_fp8.row_gemv(normed, wq, ws, launch=launch)[0].float()
            out, fused_summed = triton_fp8.row_gemv(x, wq, ws, prologue=triton_fp8.RMS_NORM, residual=residual,
                                                    norm_weight=norm_weight, eps=1e-5, launch=launch)
            err = ((out.float() - expected).abs().max() / expected.abs().max()).item()
            report(err <= 1e-2 and torch.equal(fused_summed, summed),
                   f"rms_norm N={n} K={k}: rel err {err:.2e} vs rms_norm + gemv, summed equal "
                   f"{torch.equal(fused_summed, summed)}")
        else:
            gate_up = torch.randn(1, 2 * k, device=device, generator=generator).bfloat16()
            expected = triton_fp8.row_gemv(kernels.silu_and_mul(gate_up), wq, ws, launch=launch)[0].float()
            out = triton_fp8.row_gemv(gate_up, wq, ws, prologue=triton_fp8.SILU_AND_MUL, launch=launch)[0]
            err = ((out.float() - expected).abs().max() / expected.abs().max()).item()
            report(err <= 1e-2, f"silu N={n} K={k}: rel err {err:.2e} vs silu_and_mul + gemv")
    return ok

def check_codes_gemm(device: str = "cuda", rows=(8, 32, 64)) -> bool:
    """The codes GEMM of 5-64-row steps at the 8B shapes against the exact product of the
    quantizer's codes, each call twice (split-K buffers); one PASS/FAIL line each."""
    from hearth_llm.kernels.quant import fp8, triton_fp8

    ok = True
    for (n, k), m in itertools.product([(6144, 4096), (28672, 4096), (4096, 14336)], rows):
        generator = torch.Generator(device).manual_seed(n + m)
        wq, ws = fp8.quantize_rows(torch.randn(n, k, device=device, generator=generator) * 0.02)
        x = torch.randn(m, k, device=device, generator=generator).bfloat16()
        codes, xs = triton_fp8.quantize_rows(x)
        exact = (codes.float() @ wq.float().t()) * xs[:, None] * ws[None, :]
        for call in range(2):
            out = triton_fp8.fp8_linear(x, wq, ws)
            err = ((out.float() - exact).abs().max() / exact.abs().max()).item()
            good = err <= 1e-2 and out.dtype == torch.bfloat16
            ok &= good
            print(f"{'PASS' if good else 'FAIL'} fp8 codes gemm N={n} K={k} M={m} call {call + 1}: rel err {err:.2e}",
                  flush=True)
    return ok


def check(device: str = "cuda", w4_shapes=((4096, 4096), (1000, 14336)),
          fp8_shapes=((4096, 4096), (1000, 14336), (6144, 4096))) -> bool:
    """The new GEMVs against their float32 references at 8B sizes; prints one PASS/FAIL line each."""
    from hearth_llm.kernels.quant import fp8, gguf_reference, triton_fp8, triton_w4g128

    ok = True
    torch.manual_seed(0)
    for (n, k), m in itertools.product(fp8_shapes, [1, 5, 16]):
        generator = torch.Generator(device).manual_seed(m)
        wq, ws = fp8.quantize_rows(torch.randn(n, k, device=device, generator=generator) * 0.02)
        x = torch.randn(m, k, device=device, generator=generator).bfloat16()
        bias = torch.randn(n, device=device, generator=generator).bfloat16()
        codes, xs = triton_fp8.quantize_rows(x) if device == "cuda" else fp8.quantize_rows(x)
        exact = ((codes.float() @ wq.float().t()) * xs[:, None] * ws[None, :] + bias.float())
        for recip in (False, True):
            out = triton_fp8.dot_gemv(x, wq, ws, bias, recip=recip, split_k=2 if recip else 1)
            out = triton_fp8.dot_gemv(x, wq, ws, bias, recip=recip, split_k=2 if recip else 1)  # buffers reset?
            err = ((out.float() - exact).abs().max() / exact.abs().max()).item()
            good = err <= 1e-2 and out.dtype == torch.bfloat16  # bf16 output, tensor-core accumulation
            ok &= good
            print(f"{'PASS' if good else 'FAIL'} fp8 dot gemv N={n} K={k} M={m} recip={recip} "
                  f"split={2 if recip else 1} (2nd call): rel err {err:.2e}",
                  flush=True)
    # (rows, split_k, dtype): each a compile, so few; 20 rows take the dequantize + matmul path.
    cases = [(1, 1, torch.bfloat16), (4, 1, torch.bfloat16), (1, 2, torch.bfloat16), (1, 1, torch.float32),
             (20, 1, torch.float32), (20, 1, torch.bfloat16)]
    for (n, k), (m, split, dtype) in itertools.product(w4_shapes, cases):
        codes = torch.randint(0, 16, (n, k)); scales = (torch.rand(n, k // 128) * 0.01).half()
        zeros = torch.randint(0, 16, (n, k // 128))
        data = gguf_reference.pack_w4g128(codes, scales, zeros).to(device)
        x, bias = torch.randn(m, k, device=device).to(dtype), torch.randn(n, device=device).to(dtype)
        expected = gguf_reference.gguf_linear(x.float().cpu(), data.cpu(), "W4G128", bias.float().cpu()).to(device)
        out = triton_w4g128.w4g128_linear(x, data, bias, split_k=split)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        err = ((out.float() - expected).abs().max() / expected.abs().max()).item()
        good = err <= tol and out.dtype == dtype
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} w4 N={n} K={k} M={m} split={split} {dtype}: rel err {err:.2e}", flush=True)
    return ok


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", required=True, choices=["w4", "fp8", "check", "fp8-row", "check-fp8-row",
                                                          "fp8-small-m", "fp8-round"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--configs", nargs="*", default=None,
                        help="w4: BN,GPI,WARPS,SPLIT[,PREFETCH[,J4]]; fp8 (tensor-core GEMV): "
                             "d:BN,BK,WARPS,STAGES,RECIP[,SPLIT]; several")
    parser.add_argument("--limit-s", type=float, default=1e9,
                        help="fp8-row / fp8-small-m / fp8-round: stop starting new timings after this long")
    parser.add_argument("--with-old", action="store_true", help="fp8-row: time the several-row GEMV too")
    args = parser.parse_args(argv)
    if args.part == "check":
        print("check " + ("PASS" if check() else "FAIL"), flush=True)
        return
    if args.part == "check-fp8-row":
        print("check fp8 row " + ("PASS" if check_row() else "FAIL"), flush=True)
        return
    if args.part == "fp8-round":  # one process (one CUDA start): check, the M=1 sweep, then small M
        import time

        started = time.perf_counter()
        parts = [lambda: print("check fp8 row " + ("PASS" if check_row() else "FAIL"), flush=True),
                 lambda: print("check fp8 codes gemm " + ("PASS" if check_codes_gemm() else "FAIL"), flush=True),
                 lambda: bench_row(max(0.0, (args.limit_s - (time.perf_counter() - started)) * 0.6)),
                 lambda: bench_small_m(args.rows, max(0.0, args.limit_s - (time.perf_counter() - started) - 4))]
        for part in parts:
            try:
                part()
            except Exception as error:  # the next part may still run
                print(f"fp8-round part FAILED {type(error).__name__}: {str(error)[:800]}", flush=True)
        return
    if args.part == "fp8-small-m":
        bench_small_m(args.rows, args.limit_s)
        return
    if args.part == "fp8-row":
        bench_row(args.limit_s, args.with_old)
        return
    if args.part == "w4":
        configs = [tuple(int(v) for v in c.split(",")) for c in (args.configs or [])]
        bench_w4(args.rows, configs or [(16, 8, 4, 1, 1, 1)])
    else:
        configs = [(c.split(":")[0], tuple(int(v) for v in c.split(":")[1].split(",")))
                   for c in (args.configs or [])]
        bench_fp8(args.rows, configs)


if __name__ == "__main__":
    main()
