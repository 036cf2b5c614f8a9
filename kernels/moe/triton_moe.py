"""Triton MoE for CUDA tensors: routing top-k in one kernel, experts as two grouped GEMMs over the
expert-sorted, block-aligned entries of :mod:`align` (the design of vLLM's ``fused_moe``).

1. ``select_experts``: softmax, top-k and renormalisation of each token's router logits.
2. ``align_block_size``: (token, expert) entries grouped by expert, each group padded to BLOCK_M.
3. GEMM 1: each program multiplies BLOCK_M entries' hidden rows by one expert's gate and up
   rows and writes ``silu(gate) * up`` (the activation is fused: no ``[M, 2I]`` round trip).
4. GEMM 2: the activations times the expert's down projection, scaled by the routing weight.
5. A sum over each token's ``top_k`` rows (fixed order, so results do not depend on the batch).

Every step has sizes fixed by the token count, so decode steps capture in CUDA graphs.
Importing needs Triton but no GPU; under ``TRITON_INTERPRET=1`` it runs on CPU tensors (tests).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .align import align_block_size
from .reference import check_moe_shapes, check_top_k


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Launch shape of one grouped GEMM; both GEMMs of a call share BLOCK_M (one layout)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 1


@dataclass(frozen=True, slots=True)
class MoeConfig:
    block_m: int
    up: GemmConfig     # GEMM 1, gate and up (N = intermediate size, two accumulators)
    down: GemmConfig   # GEMM 2, down (N = hidden size)


# Measured on an H200 (2026-12-01) with the Qwen3-30B-A3B expert shape (128 experts, top-8, hidden
# 2048, intermediate 768, bf16) by ``python -m hearth_llm.kernels.moe.tune --quick`` at 1, 8, 64,
# 256, 1024, 4096 and 16384 tokens; the first config whose ``max_tokens`` covers the batch's token
# count is used. Decode batches have few rows per expert and are bound by reading the experts'
# weights: small BLOCK_M and narrow tiles, so enough programs stream them (at 1 and 256 tokens the
# two GEMMs ran within 3% of that read's floor at 4.2 TB/s). Prefill fills BLOCK_M 128 tiles
# (16384 tokens: ~540 TFLOP/s). Whole MoE block (layout, routing kernel, GEMMs, top-k sum):
# 0.032 ms at 1 token, 0.127 at 8, 0.315 at 256, 0.785 at 4096.
_BIG = MoeConfig(128, GemmConfig(128, 64, 8, 4, 8), GemmConfig(256, 64, 8, 4, 8))
CONFIGS: list[tuple[int, MoeConfig]] = [
    (4, MoeConfig(16, GemmConfig(64, 128, 4, 4), GemmConfig(64, 128, 4, 3))),
    (32, MoeConfig(16, GemmConfig(32, 128, 4, 4), GemmConfig(64, 128, 4, 3))),
    (128, MoeConfig(16, GemmConfig(32, 128, 4, 3), GemmConfig(128, 128, 4, 3))),
    (512, MoeConfig(32, GemmConfig(64, 128, 4, 3), GemmConfig(128, 128, 4, 3))),
    (1 << 62, _BIG),
]


def config_for(num_tokens: int) -> MoeConfig:
    return next(config for max_tokens, config in CONFIGS if num_tokens <= max_tokens)


# Shared memory a launch may take: the H200 allows 227 KiB per block (232,448 bytes).
SHARED_MEMORY_BYTES = 232_448


def shared_memory_bytes(config: GemmConfig, block_m: int, element_size: int, gated: bool) -> int:
    """What Triton's pipeliner keeps in shared memory: ``num_stages`` copies of the A tile and the
    B tile(s) (two B tiles for the gated GEMM's gate and up halves)."""
    num_b_tiles = 2 if gated else 1
    return config.num_stages * (block_m + num_b_tiles * config.block_n) * config.block_k * element_size


def fit_shared_memory(config: GemmConfig, block_m: int, element_size: int, gated: bool,
                      limit: int = SHARED_MEMORY_BYTES) -> GemmConfig:
    """``config`` with fewer pipeline stages, then narrower K tiles, until it fits ``limit``. The
    table was tuned for bf16; fp32 inputs take twice the bytes per tile and would not launch
    (Mixtral's widths at decode needed 294,912 bytes on the H200)."""
    while shared_memory_bytes(config, block_m, element_size, gated) > limit:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_k > 16:
            config = replace(config, block_k=config.block_k // 2)
        else:
            break
    return config


# --------------------------------------------------------------------------------------------
# routing
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_tokens"])
def _select_experts_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, logits_stride,
                           TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    is_token = tokens < num_tokens
    is_expert = experts < num_experts
    logits = tl.load(logits_ptr + tokens[:, None].to(tl.int64) * logits_stride + experts[None, :],
                     mask=is_token[:, None] & is_expert[None, :], other=0.0).to(tl.float32)
    logits = tl.where(is_expert[None, :], logits, float("-inf"))
    exps = tl.exp(logits - tl.max(logits, 1)[:, None])
    remaining = exps / tl.sum(exps, 1)[:, None]
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    # Largest first, ties to the lower expert id; each pick is masked out of the next round.
    for k in tl.static_range(TOP_K):
        best = tl.max(remaining, 1)
        best_id = tl.min(tl.where(remaining == best[:, None], experts[None, :], BLOCK_E), 1)
        weights = tl.where(slots[None, :] == k, best[:, None], weights)
        ids = tl.where(slots[None, :] == k, best_id[:, None], ids)
        remaining = tl.where(experts[None, :] == best_id[:, None], -1.0, remaining)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    outputs = tokens[:, None] * TOP_K + slots[None, :]
    is_output = is_token[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + outputs, weights, mask=is_output)
    tl.store(ids_ptr + outputs, ids, mask=is_output)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`reference.select_experts`, in one launch; ids come back as int32."""
    check_top_k(top_k, router_logits.shape[-1])
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 4096 // block_e))
    _select_experts_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0),
        TOP_K=top_k, RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
    )
    return weights, ids


# --------------------------------------------------------------------------------------------
# grouped GEMMs
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_entries", "num_blocks_m"])
def _expert_gemm_kernel(
    a_ptr, b_ptr, out_ptr, topk_weights_ptr, sorted_entries_ptr, block_experts_ptr, num_padded_ptr,
    N, K, num_entries, num_blocks_m,
    a_stride_row, a_stride_k, b_stride_expert, b_stride_n, b_stride_k, out_stride_row, out_stride_n,
    ENTRIES_PER_A_ROW: tl.constexpr, GATED: tl.constexpr, MUL_ROUTING_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One program: BLOCK_M expert-sorted entries x BLOCK_N output columns of their expert.

    A row of an entry is ``entry // ENTRIES_PER_A_ROW`` (top_k for GEMM 1, whose A is the tokens'
    hidden states; 1 for GEMM 2). GATED: B's rows ``n`` and ``N + n`` are gate and up, and the
    output is ``silu(gate) * up``. Output rows are indexed by entry.
    """
    pid = tl.program_id(0)
    # Programs of GROUP_M consecutive row blocks walk the column tiles together, so an expert's
    # weight tile is read once from memory and then from L2.
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    programs_per_group = GROUP_M * num_blocks_n
    first_m = (pid // programs_per_group) * GROUP_M
    group_size = min(num_blocks_m - first_m, GROUP_M)
    block_m = first_m + (pid % programs_per_group) % group_size
    block_n = (pid % programs_per_group) // group_size
    if block_m * BLOCK_M >= tl.load(num_padded_ptr):
        return

    entries = tl.load(sorted_entries_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M))
    is_entry = entries < num_entries
    expert = tl.load(block_experts_ptr + block_m).to(tl.int64)
    columns = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_column = columns < N
    # Out-of-range columns read column 0 (finite) and are never stored: no mask in the loop.
    safe_columns = tl.where(is_column, columns, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (entries // ENTRIES_PER_A_ROW).to(tl.int64)[:, None] * a_stride_row + ks[None, :] * a_stride_k
    b_ptrs = b_ptr + expert * b_stride_expert + safe_columns[None, :] * b_stride_n + ks[:, None] * b_stride_k
    up_offset = N * b_stride_n

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=is_entry[:, None], other=0.0)
            b = tl.load(b_ptrs)
            if GATED:
                b_up = tl.load(b_ptrs + up_offset)
        else:
            is_k = ks < K - k_start
            a = tl.load(a_ptrs, mask=is_entry[:, None] & is_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=is_k[:, None], other=0.0)
            if GATED:
                b_up = tl.load(b_ptrs + up_offset, mask=is_k[:, None], other=0.0)
        if DOT_IN_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            if GATED:
                acc_up = tl.dot(a.to(tl.float32), b_up.to(tl.float32), acc_up, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
            if GATED:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K * a_stride_k
        b_ptrs += BLOCK_K * b_stride_k

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTING_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + entries, mask=is_entry, other=0.0)[:, None]
    out_ptrs = out_ptr + entries.to(tl.int64)[:, None] * out_stride_row + columns[None, :] * out_stride_n
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=is_entry[:, None] & is_column[None, :])


def _launch_gemm(a, b, out, topk_weights, layout, num_entries, entries_per_a_row, gated, block_m,
                 config: GemmConfig, n, k):
    sorted_entries, block_experts, num_padded = layout
    config = fit_shared_memory(config, block_m, a.element_size(), gated)
    num_blocks_m = block_experts.shape[0]
    grid = (num_blocks_m * triton.cdiv(n, config.block_n),)
    _expert_gemm_kernel[grid](
        a, b, out, topk_weights, sorted_entries, block_experts, num_padded,
        n, k, num_entries, num_blocks_m,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        ENTRIES_PER_A_ROW=entries_per_a_row, GATED=gated, MUL_ROUTING_WEIGHT=not gated,
        EVEN_K=k % config.block_k == 0,
        # fp32 needs an exact dot (not tf32) to agree with the reference; the interpreter (CPU
        # tensors) multiplies bf16 dot operands as raw bits, so it goes through fp32 too.
        DOT_IN_FP32=a.dtype == torch.float32 or a.device.type == "cpu",
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    """As :func:`reference.fused_moe`: fp32 accumulation, the activation rounded to ``hidden.dtype``
    once between the GEMMs, each entry's weighted output rounded once before the top-k sum.
    ``config`` overrides the measured launch table (the tuner uses it)."""
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts, intermediate_size = w13.shape[0], w2.shape[2]
    if num_tokens == 0:
        return hidden.new_empty(0, hidden_size)
    config = config or config_for(num_tokens)
    num_entries = num_tokens * top_k
    layout = align_block_size(topk_ids, num_experts, config.block_m)
    topk_weights = topk_weights.float().contiguous()
    activations = hidden.new_empty(num_entries, intermediate_size)
    _launch_gemm(hidden, w13, activations, topk_weights, layout, num_entries, top_k, True, config.block_m,
                 config.up, intermediate_size, hidden_size)
    expert_out = hidden.new_empty(num_entries, hidden_size)
    _launch_gemm(activations, w2, expert_out, topk_weights, layout, num_entries, 1, False, config.block_m,
                 config.down, hidden_size, intermediate_size)
    if top_k == 1:
        return expert_out
    return expert_out.view(num_tokens, top_k, hidden_size).sum(dim=1)
