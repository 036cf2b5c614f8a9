"""Measure launch configs of the Triton MoE GEMMs on this GPU and print the best per batch size.

    python -m hearth_llm.kernels.moe.tune                      # Qwen3-30B-A3B experts, bf16
    python -m hearth_llm.kernels.moe.tune --experts 8 --top-k 2 --hidden 4096 --intermediate 14336  # Mixtral
    python -m hearth_llm.kernels.moe.tune --tokens 1,256 --quick

Routing is uniform random (distinct experts per token), as random-weight models route. Each GEMM
is timed alone on its real layout, by CUDA-graph replay (device time, no launch gaps); candidate
kernels are compiled first by worker processes so the search spends its time measuring. The
output ends with a ``CONFIGS`` table to paste into ``triton_moe.py`` and, per batch size, the time
of the whole block against the time to read the used experts' weights once.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
from concurrent.futures import ProcessPoolExecutor

import torch
import triton

from . import triton_moe
from .align import align_block_size
from .triton_moe import GemmConfig, MoeConfig

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384]


def block_ms_for(num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    """BLOCK_M worth trying: around the mean rows per expert, at least 16."""
    rows_per_expert = num_tokens * top_k / num_experts
    return sorted({m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows_per_expert)} or {16})


def candidates(block_m: int, gated: bool, quick: bool) -> list[GemmConfig]:
    block_ns = (32, 64, 128) if gated else (64, 128, 256)
    block_ks = (64, 128, 256) if block_m <= 32 else (64, 128)
    warps = (4,) if block_m <= 32 else (4, 8)
    stages = (2, 3, 4, 5) if block_m <= 32 else (3, 4)
    groups = (1,) if block_m <= 32 else (1, 8)
    if quick:
        block_ks, stages, groups = block_ks[:2], stages[1:3], groups[-1:]
    configs = []
    for block_n, block_k, num_warps, num_stages, group_m in itertools.product(block_ns, block_ks, warps, stages,
                                                                              groups):
        # Shared memory per stage: the A tile and one (two when gated) B tiles, bf16.
        tile_bytes = 2 * block_k * (block_m + block_n * (2 if gated else 1))
        if tile_bytes * num_stages <= 200 * 1024:
            configs.append(GemmConfig(block_n, block_k, num_warps, num_stages, group_m))
    return configs


NUM_LAYERS = 4  # weight copies cycled through while timing, so no layer's experts sit in the 60 MB L2


class Problem:
    """A routed batch and NUM_LAYERS layers' expert weights, on the GPU."""

    def __init__(self, num_tokens, num_experts, top_k, hidden_size, intermediate_size, seed=0):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        kw = dict(device="cuda", dtype=torch.bfloat16, generator=generator)
        self.hidden = torch.randn(num_tokens, hidden_size, **kw)
        self.w13 = [torch.randn(num_experts, 2 * intermediate_size, hidden_size, **kw) * hidden_size ** -0.5
                    for _ in range(NUM_LAYERS)]
        self.w2 = [torch.randn(num_experts, hidden_size, intermediate_size, **kw) * intermediate_size ** -0.5
                   for _ in range(NUM_LAYERS)]
        scores = torch.rand(num_tokens, num_experts, device="cuda", generator=generator)
        self.topk_weights, self.topk_ids = torch.softmax(scores, -1).topk(top_k, -1)
        self.topk_ids = self.topk_ids.to(torch.int32)
        self.num_tokens, self.top_k, self.num_experts = num_tokens, top_k, num_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activations = self.hidden.new_empty(num_tokens * top_k, intermediate_size)
        self.expert_out = self.hidden.new_empty(num_tokens * top_k, hidden_size)

    def gemm(self, gated: bool, block_m: int, config: GemmConfig):
        """A function of the layer index that launches one GEMM on that layer's weights."""
        layout = align_block_size(self.topk_ids, self.num_experts, block_m)
        weights = self.topk_weights.float().contiguous()
        num_entries = self.num_tokens * self.top_k

        def launch(layer: int) -> None:
            if gated:
                triton_moe._launch_gemm(self.hidden, self.w13[layer], self.activations, weights, layout, num_entries,
                                        self.top_k, True, block_m, config, self.intermediate_size, self.hidden_size)
            else:
                triton_moe._launch_gemm(self.activations, self.w2[layer], self.expert_out, weights, layout,
                                        num_entries, 1, False, block_m, config, self.hidden_size,
                                        self.intermediate_size)
        return launch

    def whole_block(self, config: MoeConfig | None):
        return lambda layer: triton_moe.fused_moe(self.hidden, self.w13[layer], self.w2[layer], self.topk_weights,
                                                  self.topk_ids, config)

    def weight_read_seconds(self, bandwidth: float) -> float:
        used = torch.unique(self.topk_ids).numel()
        return used * (self.w13[0][0].numel() + self.w2[0][0].numel()) * 2 / bandwidth


def _compile(job) -> int:
    """Worker: launch each candidate once so Triton's disk cache holds it; returns how many failed."""
    shape, items = job
    problem = Problem(*shape)
    failed = 0
    for gated, block_m, config in items:
        try:
            problem.gemm(gated, block_m, config)(0)
        except (triton.runtime.errors.OutOfResources, RuntimeError):
            failed += 1
    torch.cuda.synchronize()
    return failed


def time_ms(launch, min_graph_ms: float = 2.0) -> float:
    """Device milliseconds per launch: one CUDA graph of enough launches (cycling the layers) to
    run ``min_graph_ms``, replayed five times, the fastest replay."""
    launch(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(NUM_LAYERS):
        launch(i)
    end.record()
    end.synchronize()
    estimate = max(start.elapsed_time(end) / NUM_LAYERS, 1e-3)
    num_launches = int(min(2000, max(NUM_LAYERS, min_graph_ms / estimate)))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for i in range(num_launches):
                launch(i % NUM_LAYERS)
    graph.replay()
    timings = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        timings.append(start.elapsed_time(end) / num_launches)
    return min(timings)


def tune(tokens, shape, quick: bool, num_workers: int) -> dict:
    num_experts, top_k, hidden_size, intermediate_size = shape
    jobs = {(t, m, gated, c) for t in tokens for m in block_ms_for(t, top_k, num_experts)
            for gated in (True, False) for c in candidates(m, gated, quick)}
    # One compile per (block_m, kernel, config): batch sizes share compiled kernels.
    per_kernel = sorted({(gated, m, c) for _, m, gated, c in jobs}, key=str)
    chunks = [per_kernel[i::num_workers] for i in range(num_workers)]
    compile_shape = (256, num_experts, top_k, hidden_size, intermediate_size)
    with ProcessPoolExecutor(num_workers, mp_context=torch.multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile, [(compile_shape, chunk) for chunk in chunks if chunk]))
    bandwidth = 4.2e12
    best = {}
    for num_tokens in tokens:
        problem = Problem(num_tokens, *shape)
        results = []
        for block_m in block_ms_for(num_tokens, top_k, num_experts):
            per_gemm = {}
            for gated in (True, False):
                timings = []
                for config in candidates(block_m, gated, quick):
                    try:
                        timings.append((time_ms(problem.gemm(gated, block_m, config)), config))
                    except (triton.runtime.errors.OutOfResources, RuntimeError):
                        continue
                per_gemm[gated] = min(timings, key=lambda item: item[0])
            total = per_gemm[True][0] + per_gemm[False][0]
            results.append((total, MoeConfig(block_m, per_gemm[True][1], per_gemm[False][1])))
        total, config = min(results, key=lambda item: item[0])
        whole = time_ms(problem.whole_block(config))
        default = time_ms(problem.whole_block(None))
        align_ms = time_ms(lambda layer: align_block_size(problem.topk_ids, num_experts, config.block_m))
        logits = problem.hidden[:, :num_experts].contiguous()
        select_ms = time_ms(lambda layer: triton_moe.select_experts(logits, top_k, True))
        best[num_tokens] = config
        print(json.dumps({"tokens": num_tokens, "gemms_ms": round(total, 4), "align_ms": round(align_ms, 4),
                          "select_experts_ms": round(select_ms, 4), "block_ms": round(whole, 4),
                          "block_ms_with_current_table": round(default, 4),
                          "weight_read_floor_ms": round(problem.weight_read_seconds(bandwidth) * 1e3, 4),
                          "config": repr(config)}), flush=True)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--quick", action="store_true", help="a smaller search")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    best = tune(tokens, (args.experts, args.top_k, args.hidden, args.intermediate), args.quick, args.workers)
    print("CONFIGS = [")
    for num_tokens, config in best.items():
        print(f"    ({num_tokens}, {config!r}),")
    print("]")


if __name__ == "__main__":
    main()
