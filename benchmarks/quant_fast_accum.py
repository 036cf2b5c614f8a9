"""torch._scaled_mm row-wise FP8 with and without ``use_fast_accum`` (vLLM's sm90 CUTLASS FP8
kernels use the FP8FastAccum schedules): whether it runs, its error against the float32 product
of the same codes, and µs per call at decode-batch and prefill sizes (8B qkv / gate_up / down).

    python -m hearth_llm.benchmarks.quant_fast_accum
"""
from __future__ import annotations

import torch


def main() -> None:
    from hearth_llm.benchmarks import timing
    from hearth_llm.kernels.quant import triton_fp8

    torch.manual_seed(0)
    for m in (256, 2048):
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
            weights = [triton_fp8.quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
                       for _ in range(2)]
            xq, xs = triton_fp8.quantize_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            exact = (xq.float() @ weights[0][0].float().t()) * xs[:, None] * weights[0][1][None, :]
            cells = []
            for fast in (False, True):
                def call(w, fast=fast):
                    return torch._scaled_mm(xq, w[0].t(), scale_a=xs[:, None], scale_b=w[1].float()[None, :],
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)
                try:
                    err = ((call(weights[0]).float() - exact).abs().max() / exact.abs().max()).item()
                    us = timing.graphed_us([lambda w=w: call(w) for w in weights * 4], num_warmup=2)
                    cells.append(f"fast_accum={fast}: {us:.1f} us, max rel err {err:.1e}")
                except Exception as error:  # noqa: BLE001
                    cells.append(f"fast_accum={fast}: {type(error).__name__}: {str(error)[:200]}")
            print(f"scaled_mm M={m} {n}x{k}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
