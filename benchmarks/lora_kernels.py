"""Batched LoRA kernels alone: ms per layer-projection at Llama-3-8B shapes, 8 adapters, against
the base projection's own matmul (the cost LoRA adds to), each timed as a replayed CUDA graph.
``lora_ms``: the separate shrink and expand; ``stacked_ms``: the base matmul with every slot's A stacked
under its weight (it computes the shrink too) and the expand, i.e. the base projection and its update.

    python -m hearth_llm.benchmarks.lora_kernels
    python -m hearth_llm.benchmarks.lora_kernels --compare old_triton_lora.py   # also an older add_lora

Decode-sized steps have one token per sequence, the sequences spread round-robin over the
adapters; prefill-sized steps are 8 sequences of ``T / 8`` tokens. Every run also checks the
result against the torch reference and prints ``PASS``/``FAIL``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json

import numpy as np
import torch

from .timing import graphed_us

# name: (in_features, slice sizes): Llama-3-8B's qkv_proj, o_proj, gate_up_proj, down_proj
PROJECTIONS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
               "down": (14336, (4096,))}
TOKENS = (1, 8, 64, 128, 256, 4096)


def _graph_ms(fn, num_calls: int = 10, num_replays: int = 20) -> float:
    """Device ms per call of ``fn``, from replays of a graph of ``num_calls`` calls (one warm-up call compiles)."""
    return graphed_us([fn] * num_calls, num_replays, num_warmup=1) / 1000


def _sequences(num_tokens: int, num_adapters: int) -> tuple[np.ndarray, np.ndarray]:
    if num_tokens <= 256:  # decode: a token per sequence
        return np.arange(num_tokens) % num_adapters, np.ones(num_tokens, dtype=np.int64)
    return np.arange(8) % num_adapters, np.full(8, num_tokens // 8)


def _slot_tensors(in_features, slices, num_slots, rank, device):
    out_features = sum(slices)
    a = torch.randn(num_slots, len(slices) * rank, in_features, device=device).mul_(0.01).bfloat16()
    b = torch.zeros(num_slots, len(slices) * rank, out_features, device=device, dtype=torch.bfloat16)
    bounds = np.cumsum([0, *slices])
    for piece, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        b[:, piece * rank:(piece + 1) * rank, start:end] = torch.randn(num_slots, rank, end - start,
                                                                       device=device).mul_(0.01).bfloat16()
    return a, b, torch.tensor(bounds, dtype=torch.int32, device=device)


def measure(name: str, num_tokens: int, num_adapters: int, rank: int, old=None, separate: bool = True) -> dict:
    """One projection at one step size. ``base_matmul_ms`` is what the base engine runs (plus
    ``base_silu_ms``, its SwiGLU, for gate_up); ``stacked_gemm_ms`` + ``expand_ms`` what a LoRA step runs
    (``fused_silu_ms`` for gate_up: the SwiGLU that adds the update, replacing the expand and the SwiGLU);
    ``gemv_stacked_ms`` at one row: the stacked weight by the batch-1 Triton GEMV (what a one-row step runs
    when the weight is small enough). ``separate=False`` skips the separate shrink + expand (``lora_ms``)."""
    from hearth_llm import kernels
    from hearth_llm.kernels.lora import (LoRAPlan, add_lora_planned, expand_planned, expand_silu_and_mul_planned,
                                         reference, scratch_numel)

    device = torch.device("cuda")
    in_features, slices = PROJECTIONS[name]
    out_features = sum(slices)
    a, b, bounds = _slot_tensors(in_features, slices, 8, rank, device)
    x = torch.randn(num_tokens, in_features, device=device).bfloat16()
    y = torch.zeros(num_tokens, out_features, device=device, dtype=torch.bfloat16)  # the error is the update's
    weight = torch.randn(out_features, in_features, device=device).mul_(0.01).bfloat16()
    seq_slots, counts = _sequences(num_tokens, num_adapters)
    plan = LoRAPlan(max(num_tokens, 512), 8, device)
    plan.set_sequences(seq_slots, counts)
    scratch = torch.zeros(scratch_numel(num_tokens, a.shape[1]), dtype=torch.float32, device=device)
    token_slots = torch.from_numpy(np.repeat(seq_slots, counts)).to(device)

    expected = reference.add_lora(y.float(), x.float(), token_slots, a.float(), b.float())
    result = {"projection": name, "tokens": num_tokens, "adapters": num_adapters,
              "base_matmul_ms": round(_graph_ms(lambda: torch.nn.functional.linear(x, weight)), 4)}
    if separate:
        out = add_lora_planned(y.clone(), x, plan, a, b, bounds, rank, scratch).float()
        result["max_rel_error"] = round(((out - expected).abs().max() / (expected - y.float()).abs().max()).item(), 5)
        result["lora_ms"] = round(_graph_ms(lambda: add_lora_planned(y, x, plan, a, b, bounds, rank, scratch)), 4)
        result["lora_over_matmul"] = round(result["lora_ms"] / result["base_matmul_ms"], 3)
    # A stacked under the weight: the base GEMM also computes every slot's shrink, then one expand.
    stacked = torch.cat([weight, a.reshape(-1, in_features)])
    slot_stride = a.shape[1]
    full = torch.nn.functional.linear(x, stacked)

    def stacked_step(w=stacked):
        full = torch.nn.functional.linear(x, w)
        return expand_planned(full[:, :out_features], full[:, out_features:], plan, b, bounds, rank, slot_stride)

    got = stacked_step(torch.cat([torch.zeros_like(weight), a.reshape(-1, in_features)])).float()  # the update alone
    result["stacked_max_rel_error"] = round(((got - expected).abs().max() / expected.abs().max()).item(), 5)
    result["stacked_ms"] = round(_graph_ms(stacked_step), 4)
    result["stacked_over_matmul"] = round(result["stacked_ms"] / result["base_matmul_ms"], 3)
    result["stacked_gemm_ms"] = round(_graph_ms(lambda: torch.nn.functional.linear(x, stacked)), 4)
    result["expand_ms"] = round(_graph_ms(lambda: expand_planned(full[:, :out_features], full[:, out_features:], plan,
                                                                 b, bounds, rank, slot_stride)), 4)
    if name == "gate_up":
        base_out = torch.nn.functional.linear(x, weight)
        result["base_silu_ms"] = round(_graph_ms(lambda: kernels.silu_and_mul(base_out)), 4)
        zero_a = torch.cat([torch.zeros_like(weight), a.reshape(-1, in_features)])
        update_only = torch.nn.functional.linear(x, zero_a)  # base columns zero: the update alone goes in
        fused = expand_silu_and_mul_planned(update_only[:, :out_features], update_only[:, out_features:], plan, b,
                                            rank, slot_stride).float()
        want = torch.nn.functional.silu(expected[:, :slices[0]]) * expected[:, slices[0]:]
        result["fused_silu_max_rel_error"] = round(((fused - want).abs().max() / want.abs().max()).item(), 5)
        result["fused_silu_ms"] = round(_graph_ms(lambda: expand_silu_and_mul_planned(
            full[:, :out_features], full[:, out_features:], plan, b, rank, slot_stride)), 4)
    if num_tokens == 1:  # A/B: the one-token kernels against the general ones (the sorted-token load first)
        from hearth_llm.kernels.lora import triton_lora
        triton_lora.ONE_TOKEN_STEPS = False
        try:
            result["expand_ms_general"] = round(_graph_ms(lambda: expand_planned(
                full[:, :out_features], full[:, out_features:], plan, b, bounds, rank, slot_stride)), 4)
            if name == "gate_up":
                result["fused_silu_ms_general"] = round(_graph_ms(lambda: expand_silu_and_mul_planned(
                    full[:, :out_features], full[:, out_features:], plan, b, rank, slot_stride)), 4)
        finally:
            triton_lora.ONE_TOKEN_STEPS = True
    if num_tokens == 1 and stacked.numel() <= (1 << 25):
        from hearth_llm.kernels.gemv import triton_gemv
        result["gemv_stacked_ms"] = round(_graph_ms(lambda: triton_gemv.linear(x, stacked)), 4)
        result["gemv_base_ms"] = round(_graph_ms(lambda: triton_gemv.linear(x, weight)), 4)
    if old is not None:
        result["old_lora_ms"] = round(_graph_ms(lambda: old.add_lora(y, x, token_slots, a, b)), 4)
    return result


def layer_summary(rows: list[dict]) -> dict:
    """ms per layer: the base engine's four projections (+ SwiGLU), a LoRA step's before the fused SwiGLU
    (stacked GEMM + expand everywhere, + SwiGLU) and with it; at one row, the GEMV where it applies."""
    by_name = {r["projection"]: r for r in rows}
    gate_up = by_name["gate_up"]
    base = sum(r["base_matmul_ms"] for r in rows) + gate_up["base_silu_ms"]
    expand_everywhere = sum(r["stacked_gemm_ms"] + r["expand_ms"] for r in rows) + gate_up["base_silu_ms"]
    fused = sum(r["stacked_gemm_ms"] + r["expand_ms"] for r in rows if r is not gate_up) \
        + gate_up["stacked_gemm_ms"] + gate_up["fused_silu_ms"]
    summary = {"tokens": rows[0]["tokens"], "base_ms": round(base, 4), "lora_expand_ms": round(expand_everywhere, 4),
               "lora_fused_silu_ms": round(fused, 4), "expand_ratio": round(expand_everywhere / base, 3),
               "fused_silu_ratio": round(fused / base, 3)}
    if any("gemv_stacked_ms" in r for r in rows):
        def matmul(r, stacked):
            key = ("gemv_stacked_ms" if stacked else "gemv_base_ms") if "gemv_base_ms" in r else None
            return r[key] if key else (r["stacked_gemm_ms"] if stacked else r["base_matmul_ms"])
        gemv_base = sum(matmul(r, False) for r in rows) + gate_up["base_silu_ms"]
        gemv_lora = sum(matmul(r, True) + r["expand_ms"] for r in rows if r is not gate_up) \
            + gate_up["stacked_gemm_ms"] + gate_up["fused_silu_ms"]
        summary.update(gemv_base_ms=round(gemv_base, 4), gemv_lora_ms=round(gemv_lora, 4),
                       gemv_ratio=round(gemv_lora / gemv_base, 3))
    return summary


def sweep(num_tokens: int, rank: int) -> list[dict]:
    """ms per layer (the four projections) for a few launch shapes: K splits and expand programs are
    runtime choices (no recompilation), so this shows which the defaults should be."""
    from hearth_llm.kernels.lora import triton_lora

    defaults = triton_lora._MAX_SPLITS, triton_lora._TARGET_EXPAND_PROGRAMS
    rows = []
    try:
        for max_splits in (4, 8, 16):
            for expand_programs in (264, 528, 1056):
                triton_lora._MAX_SPLITS, triton_lora._TARGET_EXPAND_PROGRAMS = max_splits, expand_programs
                ms = sum(measure(name, num_tokens, 8, rank)["lora_ms"] for name in PROJECTIONS)
                rows.append({"tokens": num_tokens, "max_splits": max_splits, "expand_programs": expand_programs,
                             "lora_ms_per_layer": round(ms, 4)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        triton_lora._MAX_SPLITS, triton_lora._TARGET_EXPAND_PROGRAMS = defaults
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", help="a Python file with an older add_lora(y, x, token_slots, a, b) to time too")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--sweep", type=int, nargs="*", default=(), help="token counts to sweep launch shapes at")
    parser.add_argument("--no-separate", action="store_true", help="skip the separate shrink + expand (lora_ms)")
    parser.add_argument("--no-pdl", action="store_true",
                        help="plain launches of the expands (programmatic dependent launch is the default)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.no_pdl:
        from hearth_llm.kernels.lora import triton_lora

        triton_lora.USE_PDL = False
    old = None
    if args.compare:
        spec = importlib.util.spec_from_file_location("old_triton_lora", args.compare)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    results, is_exact = [], True
    for num_tokens in args.tokens:
        for name in PROJECTIONS:
            result = measure(name, num_tokens, args.adapters, args.rank, old, separate=not args.no_separate)
            is_exact &= all(value < 0.02 for key, value in result.items() if key.endswith("max_rel_error"))
            print(json.dumps(result), flush=True)
            results.append(result)
    for num_tokens in args.tokens:
        rows = [r for r in results if r["tokens"] == num_tokens]
        layer = {key: round(sum(r[key] for r in rows), 4) for key in ("base_matmul_ms", "lora_ms", "stacked_ms",
                                                                       "old_lora_ms")
                 if key in rows[0]}
        print(json.dumps({"tokens": num_tokens, "per_layer": layer, **layer_summary(rows)}), flush=True)
    print(("PASS" if is_exact else "FAIL") + " lora kernels match the reference (max error < 2% of the update)")
    for num_tokens in args.sweep:
        results += sweep(num_tokens, args.rank)
    if args.json:
        with open(args.json, "w") as sink:
            json.dump(results, sink, indent=2)


if __name__ == "__main__":
    main()
