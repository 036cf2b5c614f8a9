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


def measure(name: str, num_tokens: int, num_adapters: int, rank: int, old=None) -> dict:
    from hearth_llm.kernels.lora import LoRAPlan, add_lora_planned, expand_planned, reference, scratch_numel

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

    out = add_lora_planned(y.clone(), x, plan, a, b, bounds, rank, scratch).float()
    expected = reference.add_lora(y.float(), x.float(), token_slots, a.float(), b.float())
    error = ((out - expected).abs().max() / (expected - y.float()).abs().max()).item()
    result = {"projection": name, "tokens": num_tokens, "adapters": num_adapters,
              "base_matmul_ms": round(_graph_ms(lambda: torch.nn.functional.linear(x, weight)), 4),
              "lora_ms": round(_graph_ms(lambda: add_lora_planned(y, x, plan, a, b, bounds, rank, scratch)), 4),
              "max_rel_error": round(error, 5)}
    # A stacked under the weight: the base GEMM also computes every slot's shrink, then one expand.
    stacked = torch.cat([weight, a.reshape(-1, in_features)])
    slot_stride = a.shape[1]

    def stacked_step(w=stacked):
        full = torch.nn.functional.linear(x, w)
        return expand_planned(full[:, :out_features], full[:, out_features:], plan, b, bounds, rank, slot_stride)

    got = stacked_step(torch.cat([torch.zeros_like(weight), a.reshape(-1, in_features)])).float()  # the update alone
    result["stacked_max_rel_error"] = round(((got - expected).abs().max() / expected.abs().max()).item(), 5)
    result["stacked_ms"] = round(_graph_ms(stacked_step), 4)
    result["stacked_over_matmul"] = round(result["stacked_ms"] / result["base_matmul_ms"], 3)
    if old is not None:
        result["old_lora_ms"] = round(_graph_ms(lambda: old.add_lora(y, x, token_slots, a, b)), 4)
    result["lora_over_matmul"] = round(result["lora_ms"] / result["base_matmul_ms"], 3)
    return result


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
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    old = None
    if args.compare:
        spec = importlib.util.spec_from_file_location("old_triton_lora", args.compare)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    results, is_exact = [], True
    for num_tokens in args.tokens:
        for name in PROJECTIONS:
            result = measure(name, num_tokens, args.adapters, args.rank, old)
            is_exact &= result["max_rel_error"] < 0.02 and result["stacked_max_rel_error"] < 0.02
            print(json.dumps(result), flush=True)
            results.append(result)
    for num_tokens in args.tokens:
        rows = [r for r in results if r["tokens"] == num_tokens]
        layer = {key: round(sum(r[key] for r in rows), 4) for key in ("base_matmul_ms", "lora_ms", "stacked_ms",
                                                                       "old_lora_ms")
                 if key in rows[0]}
        print(json.dumps({"tokens": num_tokens, "per_layer": layer}), flush=True)
    print(("PASS" if is_exact else "FAIL") + " lora kernels match the reference (max error < 2% of the update)")
    for num_tokens in args.sweep:
        results += sweep(num_tokens, args.rank)
    if args.json:
        with open(args.json, "w") as sink:
            json.dump(results, sink, indent=2)


if __name__ == "__main__":
    main()
