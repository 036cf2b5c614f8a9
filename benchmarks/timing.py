"""Device time of GPU calls, measured the way the kernel benchmarks all measure it: captured once into
a CUDA graph and replayed, so launch overhead and the host drop out and only the kernels count.

>>> x, w = torch.randn(1, 4096, device="cuda"), torch.randn(4096, 4096, device="cuda")
>>> us = graphed_us([lambda: torch.nn.functional.linear(x, w)] * 10)     # µs per call
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def graphed_us(calls: Sequence[Callable[[], object]], replays: int = 10, num_warmup: int | None = None) -> float:
    """Device microseconds per call of ``calls`` (zero-argument functions, run in order), from
    ``replays`` replays of one CUDA graph holding all of them.

    Before the capture, the first ``num_warmup`` calls (all of them when None) run once on a side
    stream: Triton compiles and cuBLAS picks its kernels there, which must not happen inside a
    capture. One untimed replay follows the capture. To keep a weight from being read out of L2 on
    every call, give calls that cycle through enough copies of it (``benchmarks/quant_kernels.py``).
    """
    if not calls:
        raise ValueError("calls must hold at least one function")
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls if num_warmup is None else calls[:num_warmup]:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(calls))
