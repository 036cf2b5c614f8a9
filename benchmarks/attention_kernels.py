"""Attention kernel microbenchmark on CUDA: decode and prefill launch variants over a paged cache
laid out as the engine lays it out, timed inside CUDA graphs over as many layers' caches as it
takes to defeat the L2 cache. Prints us per layer call and GB/s (decode) or TFLOP/s (prefill).

    python -m hearth_llm.benchmarks.attention_kernels --budget-s 80

Not a test: it prints numbers to choose launch shapes from. ``--check`` also compares every
variant's output with the torch reference (bf16 and fp8 caches) and prints PASS/FAIL lines.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time

import torch

from .timing import graphed_us

SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama3-8b": (32, 8, 128)}  # query heads, KV heads, head_dim
BLOCK_SIZE = 16
# --smoke: tiny cases on the CPU (Triton interpreter), to check the script itself runs.
DEVICE = "cuda"
L2_DEFEAT_BYTES = 256 << 20


@dataclasses.dataclass
class PagedBatch:
    query: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_context_len: int
    kv_bytes: int
    flops: int


def paged_batch(shape: str, context_lens: list[int], query_lens: list[int], dtype=torch.bfloat16,
                cache_dtype=torch.bfloat16, seed: int = 0) -> PagedBatch:
    """Random queries and caches; each sequence's blocks are a random sample of the pool, as a
    long-running engine's free queue hands them out. Enough layer copies to exceed L2."""
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = [math.ceil(c / BLOCK_SIZE) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 8
    width = 16 * math.ceil(max(blocks_per_seq) / 16)
    order = torch.randperm(num_blocks, device=DEVICE, generator=gen)
    tables = torch.zeros(len(context_lens), width, dtype=torch.long, device=DEVICE)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[start:start + n]
        start += n
    layer_bytes = num_blocks * BLOCK_SIZE * num_kv_heads * head_dim * 2 * torch.empty((), dtype=cache_dtype).element_size()
    num_layers = max(2, min(28, math.ceil(L2_DEFEAT_BYTES / layer_bytes)))
    caches = []
    for _ in range(num_layers):
        kv = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=DEVICE, generator=gen)
        kv = kv.clamp(-448, 448).to(cache_dtype)
        caches.append((kv[0], kv[1]))
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE, generator=gen).to(dtype)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.long, device=DEVICE)
    qsl[1:] = torch.tensor(query_lens, device=DEVICE).cumsum(0)
    element = torch.empty((), dtype=cache_dtype).element_size()
    kv_bytes = sum(context_lens) * num_kv_heads * head_dim * 2 * element
    # causal: query i of a sequence with context c and q new tokens sees c - q + i + 1 keys
    visible = sum(q * (c - q) + q * (q + 1) // 2 for c, q in zip(context_lens, query_lens))
    flops = 4 * visible * num_heads * head_dim
    return PagedBatch(query, caches, tables, torch.tensor(context_lens, device=DEVICE), qsl, max(query_lens),
                      max(context_lens), kv_bytes, flops)


def time_per_call_us(fn_of_layer, num_layers: int, replays: int = 8) -> float:
    """One CUDA graph runs the call once per layer; the mean over replays, per call."""
    if DEVICE == "cpu":
        began = time.perf_counter()
        fn_of_layer(0)
        return (time.perf_counter() - began) * 1e6
    return graphed_us([functools.partial(fn_of_layer, layer) for layer in range(num_layers)], replays)


def _common(batch: PagedBatch, scale: float):
    from hearth_llm.kernels.triton_utils import LOG2_E, next_power_of_2
    num_heads, head_dim = batch.query.shape[1:]
    num_kv_heads = batch.caches[0][0].shape[2]
    return dict(num_queries_per_kv=num_heads // num_kv_heads, block_size=BLOCK_SIZE, head_dim=head_dim,
                softmax_scale_log2=scale * LOG2_E, soft_cap_log2=LOG2_E, sliding_window=0,
                HAS_SLIDING_WINDOW=False, HAS_SOFT_CAP=False, BLOCK_D=next_power_of_2(head_dim),
                DOT_IN_FP32=DEVICE == "cpu")


def decode_variants():
    from hearth_llm.kernels.attention.triton_attention import DEFAULT_LAUNCH, PREVIOUS_LAUNCH, DecodeLaunch
    # (block_n, num_warps, num_stages, use_dot); the default is timed first on its own
    # most plausible first: a short budget runs only the first few
    tiles = [(128, 4, 2, True), (32, 4, 2, False), (128, 8, 2, True), (64, 8, 2, True), (32, 4, 2, True),
             (16, 4, 2, False), (64, 4, 3, True), (64, 8, 2, False), (128, 8, 3, True), (256, 8, 2, True),
             (64, 4, 4, True), (128, 4, 3, True), (64, 4, 2, False), (32, 4, 3, False)]
    launches = [DecodeLaunch(n, w, s, use_dot=dot) for n, w, s, dot in tiles]
    return DEFAULT_LAUNCH, [("previous default " + _describe(PREVIOUS_LAUNCH), PREVIOUS_LAUNCH)] + [
        ("new " + _describe(launch), launch) for launch in launches]


def _gbs(batch: PagedBatch, us: float) -> float:
    return batch.kv_bytes / (us * 1e-6) / 1e9


def _describe(launch) -> str:
    return (f"N{launch.block_n}/w{launch.num_warps}/s{launch.num_stages}/p{launch.programs_per_sm}"
            f"/min{launch.min_split_tokens}{'' if launch.use_dot else '/nodot'}"
            f"{f'/r{launch.maxnreg}' if launch.maxnreg else ''}{'/hf' if launch.heads_fastest else ''}"
            f"{f'/fp8N{launch.fp8_block_n}' if launch.fp8_block_n else ''}")


def run_decode(batch: PagedBatch, launch, graph_max_context_len: int | None = None) -> float:
    from hearth_llm.kernels.attention.triton_attention import decode_attention
    out = torch.empty_like(batch.query)
    common = _common(batch, batch.query.shape[-1] ** -0.5)
    max_len = graph_max_context_len or batch.max_context_len
    return time_per_call_us(lambda layer: decode_attention(
        out, batch.query, *batch.caches[layer], batch.block_tables, batch.context_lens, batch.query_start_loc,
        max_len, None, common, launch), len(batch.caches))


def run_prefill(batch: PagedBatch, block_m: int, block_n: int, warps: int, stages: int, lazy: bool = False) -> float:
    """µs per layer call of the paged prefill kernel with these tiles (``lazy``: PREFILL_LAZY_RESCALE)."""
    from hearth_llm.kernels.attention import triton_attention as ta
    saved = (ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N, ta.PREFILL_NUM_WARPS, ta.PREFILL_NUM_STAGES,
             ta.PREFILL_LAZY_RESCALE)
    ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N, ta.PREFILL_NUM_WARPS, ta.PREFILL_NUM_STAGES = block_m, block_n, warps, stages
    ta.PREFILL_LAZY_RESCALE = lazy
    try:
        scale = batch.query.shape[-1] ** -0.5
        return time_per_call_us(lambda layer: ta.paged_attention(
            batch.query, *batch.caches[layer], batch.block_tables, batch.context_lens, batch.query_start_loc,
            batch.max_query_len, batch.max_context_len, scale), len(batch.caches), replays=3)
    finally:
        (ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N, ta.PREFILL_NUM_WARPS, ta.PREFILL_NUM_STAGES,
         ta.PREFILL_LAZY_RESCALE) = saved


def _context_slots(batch: PagedBatch) -> torch.Tensor:
    """Flat cache slots of every sequence's context, concatenated (host work done once, before capture)."""
    slots = []
    for seq, context_len in enumerate(batch.context_lens.tolist()):
        blocks = batch.block_tables[seq, :math.ceil(context_len / BLOCK_SIZE)]
        slots.append((blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=blocks.device)).flatten()[:context_len])
    return torch.cat(slots)


def _contiguous_kv(batch: PagedBatch, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values gathered out of the paged cache, concatenated ``[sum(c), Hkv, D]``."""
    key_cache, value_cache = batch.caches[layer]
    return key_cache.flatten(0, 1).index_select(0, slots), value_cache.flatten(0, 1).index_select(0, slots)


def flash_prefill_comparison(report, shape: str = "llama3-8b") -> None:
    """Our paged prefill kernel against torch's bundled FlashAttention-2 varlen forward
    (``aten._flash_attention_forward``, causal bottom-right, GQA) on contiguous keys: fresh 8k
    prompts and a 2,048-token chunk over 8,192 keys, TFLOP/s; with and without the gather."""
    from hearth_llm.kernels.attention import triton_attention as ta
    for contexts, queries, label in (([8192, 8192], [8192, 8192], "2 x 8k fresh"),
                                     ([8192, 8192], [2048, 2048], "2 x 2048 chunk over 8k")):
        batch = paged_batch(shape, contexts, queries)
        batch.caches = batch.caches[:4]
        scale = batch.query.shape[-1] ** -0.5
        ours_us = run_prefill(batch, ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N, ta.PREFILL_NUM_WARPS, ta.PREFILL_NUM_STAGES)
        if label.endswith("fresh"):  # a few other tiles of ours, on the case that decides the long mix
            cells = []
            for *tiles, lazy in ((128, 32, 4, 2, True), (128, 64, 8, 3, False), (128, 64, 8, 3, True),
                                 (128, 128, 8, 3, True), (64, 64, 4, 3, False)):
                us = run_prefill(batch, *tiles, lazy=lazy)
                cells.append(f"M{tiles[0]}/N{tiles[1]}/w{tiles[2]}/s{tiles[3]}{'/lazy' if lazy else ''} "
                             f"{batch.flops / us / 1e6:.0f}")
            report(f"prefill {shape} {label} tiles (TFLOP/s): default M{ta.PREFILL_BLOCK_M}/N{ta.PREFILL_BLOCK_N}/"
                   f"w{ta.PREFILL_NUM_WARPS}/s{ta.PREFILL_NUM_STAGES} {batch.flops / ours_us / 1e6:.0f} | " + " | ".join(cells))
        cu_q = batch.query_start_loc.to(torch.int32)
        cu_k = torch.zeros_like(cu_q)
        cu_k[1:] = batch.context_lens.cumsum(0)
        slots = _context_slots(batch)
        gathered = [_contiguous_kv(batch, layer, slots) for layer in range(len(batch.caches))]

        def flash(layer, gather=False, batch=batch, gathered=gathered, slots=slots, cu_q=cu_q, cu_k=cu_k, scale=scale):
            key, value = _contiguous_kv(batch, layer, slots) if gather else gathered[layer]
            return torch.ops.aten._flash_attention_forward(
                batch.query, key, value, cu_q, cu_k, batch.max_query_len, batch.max_context_len, 0.0, True, False,
                scale=scale)[0]

        try:
            flash_us = time_per_call_us(flash, len(batch.caches), replays=3)
            gather_us = time_per_call_us(lambda layer: flash(layer, True), len(batch.caches), replays=3)
            args = (batch.query, *batch.caches[0], batch.block_tables, batch.context_lens, batch.query_start_loc,
                    batch.max_query_len, batch.max_context_len, scale)
            ours = ta.paged_attention(*args).float()
            diff = (flash(0).float() - ours).abs().max().item()
            report(f"prefill {shape} {label}: ours {ours_us:.0f}us {batch.flops / ours_us / 1e6:.0f} TFLOP/s | "
                   f"flash2 {flash_us:.0f}us {batch.flops / flash_us / 1e6:.0f} TFLOP/s | gather+flash2 {gather_us:.0f}us "
                   f"| max|flash - ours| {diff:.2e}")
        except Exception as error:  # noqa: BLE001  (a missing or refusing op is a result too)
            report(f"prefill {shape} {label}: ours {ours_us:.0f}us {batch.flops / ours_us / 1e6:.0f} TFLOP/s | "
                   f"flash2 failed: {type(error).__name__}: {str(error)[:300]}")


def routed_prefill_comparison(report, budget_s: float = 60.0) -> None:
    """The engine's prefill attention both ways on steps of the long-context mix and the benchmark
    workload: all on the paged Triton kernels (``ta.paged_attention``) against long prefills on
    FlashAttention-2 (``flash_prefill.paged_attention``: gather + varlen forward, the rest on the
    Triton kernels) with its plan built as the runner builds it; µs per layer call in CUDA graphs,
    TFLOP/s of the whole step's attention, and max |routed - Triton| (bf16)."""
    from hearth_llm.kernels.attention import flash_prefill
    from hearth_llm.kernels.attention import triton_attention as ta
    began = time.perf_counter()
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(100, 1025, (30,), generator=gen).tolist()
    decode_contexts = torch.randint(200, 2049, (200,), generator=gen).tolist()
    cases = [  # the most telling first: a short budget runs only the first few
        ("llama3-8b", "2 x 8k fresh", [8192, 8192], [8192, 8192]),
        ("llama3-8b", "30 prompts U[100,1024]", prompts, prompts),
        ("llama3-8b", "8192 + 8180 fresh + 6 over 8192 + 16 decode rows over 8.3k",
         [8192, 8180, 8192] + [8300] * 16, [8192, 8180, 6] + [1] * 16),
        ("llama3-8b", "burst: 2112 fresh + 63 x 64 over 2112", [2112] * 64, [2112] + [64] * 63),
        ("llama3-8b", "30 prompts U[100,1024] + 200 decode rows U[200,2048]", prompts + decode_contexts,
         prompts + [1] * 200),
        ("llama3-8b", "2 x 2048 chunk over 8k", [8192, 8192], [2048, 2048]),
        ("qwen3-0.6b", "2 x 8k fresh", [8192, 8192], [8192, 8192]),
    ]
    for shape, label, contexts, queries in cases:
        if time.perf_counter() - began > budget_s:
            report("  (out of time: later routed cases skipped)")
            break
        batch = paged_batch(shape, contexts, queries)
        batch.caches = batch.caches[:4]
        scale = batch.query.shape[-1] ** -0.5
        table = batch.block_tables.cpu().numpy()
        plan = flash_prefill.plan_flash_prefill(queries, contexts, table, BLOCK_SIZE,
                                                lambda arrays: [torch.as_tensor(a, dtype=torch.long).to(DEVICE)
                                                                for a in arrays])

        def triton(layer, batch=batch, scale=scale):
            return ta.paged_attention(batch.query, *batch.caches[layer], batch.block_tables, batch.context_lens,
                                      batch.query_start_loc, batch.max_query_len, batch.max_context_len, scale)

        def routed(layer, batch=batch, scale=scale, plan=plan):
            return flash_prefill.paged_attention(batch.query, *batch.caches[layer], plan, scale, None,
                                                 attend_rest=ta.paged_attention)

        try:
            triton_us = time_per_call_us(triton, len(batch.caches), replays=3)
            if plan is None:
                report(f"routed {shape} {label}: no sequence routed | triton {triton_us:.0f}us")
                continue
            routed_us = time_per_call_us(routed, len(batch.caches), replays=3)
            diff = (routed(0).float() - triton(0).float()).abs().max().item()
            report(f"routed {shape} {label}: triton {triton_us:.0f}us {batch.flops / triton_us / 1e6:.0f} TFLOP/s | "
                   f"flash-routed {routed_us:.0f}us {batch.flops / routed_us / 1e6:.0f} TFLOP/s "
                   f"({triton_us / routed_us:.2f}x) | {'PASS' if diff < 3e-2 else 'FAIL'} "
                   f"max|routed - triton| {diff:.2e}")
        except Exception as error:  # noqa: BLE001  (a missing or refusing op is a result too)
            report(f"routed {shape} {label}: FAIL {type(error).__name__}: {str(error)[:300]}")
        del batch
        torch.cuda.empty_cache()


def long_mix(shape: str, report, flash_modes: list, num_requests: int | None = None) -> None:
    """The long-context mix (32 x 8,192-token prompts, 512 new tokens) through our engine once per
    entry of ``flash_modes`` (long prefills on FlashAttention-2 or not: True/"on", False/"off"; "cudnn":
    steps of fresh prompts on cuDNN, ``flash_prefill.CUDNN_FRESH``), with each step's forward timed
    on the device (CUDA events around ``runner.run``) and split by kind: steps with prefill tokens, and
    decode-only steps. The first run takes the workload's own ids (as ``bench throughput`` and vLLM's
    side), later ones the same ids shifted (no prefix hits); the same warm-up and timing as the bench's."""
    from hearth_llm.kernels.attention import flash_prefill

    from .throughput import engine_generate, our_engine, random_checkpoint
    from .workloads import LONG_CONTEXT, long_context, max_model_len_for, warmup_batches
    requests, prompt_len, new_tokens = LONG_CONTEXT
    workload = long_context(num_requests or requests, prompt_len, new_tokens)
    max_model_len = max_model_len_for(LONG_CONTEXT)
    built = time.perf_counter()
    _, checkpoint = random_checkpoint(shape, torch.bfloat16, DEVICE, max_model_len=max_model_len)
    engine = our_engine(checkpoint, "bfloat16", max_num_seqs=256, kv_cache_memory="40GiB",
                        max_model_len=max_model_len, max_num_batched_tokens=16384)
    del checkpoint
    generate = engine_generate(engine)
    for batch in warmup_batches():
        generate(batch, [4] * len(batch))
    report(f"long mix {shape}: engine built and warmed in {time.perf_counter() - built:.1f}s")
    runner, steps = engine.runner, []
    original_run = runner.run

    def timed_run(batch, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        output = original_run(batch, *args, **kwargs)
        end.record()
        steps.append((sum(batch.num_new_tokens), len(batch.num_new_tokens), start, end))
        return output

    runner.run = timed_run
    saved, saved_cudnn = flash_prefill.ENABLED, flash_prefill.CUDNN_FRESH
    try:
        for run, mode in enumerate(flash_modes):
            use_flash = mode not in (False, "off")
            flash_prefill.ENABLED, flash_prefill.CUDNN_FRESH = use_flash, mode == "cudnn"
            prompts = [[(token + run) % 10000 for token in prompt] for prompt, _ in workload]
            steps.clear()
            seconds, num_output = generate(prompts, [new_tokens] * len(prompts))
            torch.cuda.synchronize()
            prefill = [(tokens, start.elapsed_time(end)) for tokens, seqs, start, end in steps if tokens > seqs]
            decode = [start.elapsed_time(end) for tokens, seqs, start, end in steps if tokens == seqs]
            prefill_ms, decode_ms = sum(ms for _, ms in prefill), sum(decode)
            if use_flash and not flash_prefill.ENABLED:
                report("long mix: FlashAttention-2 turned itself off during the run (see the warning above)")
            if mode == "cudnn" and not flash_prefill.CUDNN_FRESH:
                report("long mix: the cuDNN route turned itself off during the run (see the warning above)")
            label = mode if isinstance(mode, str) else ("on" if mode else "off")
            report(f"long mix {shape} flash={label}: {seconds:.2f}s, {num_output} tokens, "
                   f"{len(steps)} steps | device time of forwards: steps with prefill {len(prefill)} x "
                   f"{prefill_ms / max(len(prefill), 1):.1f}ms = {prefill_ms / 1000:.2f}s, decode-only {len(decode)} x "
                   f"{decode_ms / max(len(decode), 1):.2f}ms = {decode_ms / 1000:.2f}s, the rest of the wall time "
                   f"{seconds - (prefill_ms + decode_ms) / 1000:.2f}s")
    finally:
        flash_prefill.ENABLED, flash_prefill.CUDNN_FRESH = saved, saved_cudnn
        runner.run = original_run
    if "cudnn" in flash_modes:  # the flash side's fresh steps on cuDNN
        flash_prefill.CUDNN_FRESH = True
    try:
        top5_check(engine, report)
    finally:
        flash_prefill.CUDNN_FRESH = saved_cudnn


def top5_check(engine, report, prompt_lens=(5, 40, 130, 300, 1000, 3000, 8000, 8000),
               num_tokens: int = 32) -> None:
    """Greedy bf16 generations with long prefills on FlashAttention-2 against the same engine with
    them on the Triton kernels (which ``tests/test_gpu_engine.py`` checks against HF), by the top-5 rule
    vLLM's ``check_logprobs_close`` uses: up to the first divergence the tokens are equal, and there
    each side's token is in the other's top 5. The default prompts overflow a 16,384-token step, so the
    last one is chunked and its second chunk attends over cached keys."""
    import random

    from hearth_llm.engine.sampling_params import SamplingParams
    from hearth_llm.kernels.attention import flash_prefill
    rng = random.Random(3)
    prompts = [[rng.randint(0, 9999) for _ in range(n)] for n in prompt_lens]
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, detokenize=False, logprobs=5)
    sides = []
    saved = flash_prefill.ENABLED
    try:
        for use_flash in (True, False):
            flash_prefill.ENABLED = use_flash
            ids = [engine.add_request(prompt, params) for prompt in prompts]
            while engine.has_unfinished_requests():
                engine.step()
            requests = [engine.groups[request_id][0] for request_id in ids]
            sides.append([(list(r.output_token_ids), [set(entry) for entry in r.logprobs]) for r in requests])
            for request_id in ids:
                engine.release(request_id)
    finally:
        flash_prefill.ENABLED = saved
    num_identical = num_before = 0
    passed = True
    for (ours, our_tops), (theirs, their_tops) in zip(*sides):
        for step, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                passed &= a in their_tops[step] and b in our_tops[step]
                break
            num_before += 1
        num_identical += ours == theirs
    report(f"{'PASS' if passed else 'FAIL'} top-5 rule, flash vs Triton prefill, prompts {list(prompt_lens)}: "
           f"{num_identical}/{len(prompts)} identical, "
           f"{num_before}/{len(prompts) * num_tokens} tokens before divergence")


def fused_reduce_comparison(report) -> None:
    """The split decode kernel with its pieces merged by the last piece (``fused_reduce``) against
    the reduce kernel: closeness to the torch reference (bf16), then µs per layer call in CUDA
    graphs captured for a 4,096-key context (as the engine's are; 8k contexts at their own length)."""
    import dataclasses as dc

    from hearth_llm.kernels.attention import reference
    from hearth_llm.kernels.attention import triton_attention as ta
    fused = dc.replace(ta.DEFAULT_LAUNCH, fused_reduce=True)
    gen = torch.Generator().manual_seed(7)
    contexts = torch.randint(1, 3000, (24,), generator=gen).tolist()
    batch = paged_batch("llama3-8b", contexts, [1] * len(contexts), seed=9)
    out = torch.empty_like(batch.query)
    expected_out = reference.paged_attention(batch.query, *batch.caches[0], batch.block_tables, batch.context_lens,
                                             batch.query_start_loc, 1, batch.max_context_len,
                                             128 ** -0.5).float()
    for _ in range(3):  # again on the same counters: each launch must leave them at 0
        ta.decode_attention(out, batch.query, *batch.caches[0], batch.block_tables, batch.context_lens,
                            batch.query_start_loc, 4096, None, _common(batch, 128 ** -0.5), fused)
    err = (out.float() - expected_out).abs().max().item()
    counters = ta._merge_counters(batch.caches[0][0], 1)
    zero = int(counters.abs().sum().item()) == 0
    report(f"{'PASS' if err < 2e-2 and zero else 'FAIL'} fused-merge decode closeness max|diff|={err:.2e}, "
           f"counters back at 0: {zero}")
    cases = [("qwen3-0.6b", "B256 U[200,2048]", torch.randint(200, 2049, (256,), generator=gen).tolist()),
             ("llama3-8b", "B32 ctx8192", [8192] * 32), ("llama3-8b", "B1 ctx2048", [2048]),
             ("qwen3-0.6b", "B1 ctx100", [100]), ("qwen3-0.6b", "B64 U[200,2048]",
                                                  torch.randint(200, 2049, (64,), generator=gen).tolist())]
    for shape, label, lens in cases:
        batch = paged_batch(shape, lens, [1] * len(lens))
        graph_len = 4096 if max(lens) <= 4096 else None
        plain_us = run_decode(batch, ta.DEFAULT_LAUNCH, graph_len)
        fused_us = run_decode(batch, fused, graph_len)
        report(f"decode {shape} {label}: reduce kernel {plain_us:.1f}us | fused merge {fused_us:.1f}us "
               f"({plain_us / fused_us:.2f}x)")
        del batch


def decode_cases(smoke: bool = False):
    gen = torch.Generator().manual_seed(1)
    if smoke:
        return [("qwen3-0.6b", "B3 smoke", [300, 5, 700]), ("llama3-8b", "B1 smoke", [1000])]

    def uniform(n):
        return torch.randint(200, 2049, (n,), generator=gen).tolist()
    return [
        ("qwen3-0.6b", "B256 U[200,2048]", uniform(256)),
        ("qwen3-0.6b", "B64 U[200,2048]", uniform(64)),
        ("llama3-8b", "B256 U[200,2048]", uniform(256)),
        ("qwen3-0.6b", "B256 ctx512", [512] * 256),
        ("llama3-8b", "B32 ctx8192", [8192] * 32),
        ("llama3-8b", "B1 ctx2048", [2048]),
        ("llama3-8b", "B1 ctx8192", [8192]),
    ]


def check_closeness(report) -> None:
    """Each decode variant and the prefill kernel against the torch reference, bf16 and fp8 caches."""
    from hearth_llm.kernels.attention import reference
    from hearth_llm.kernels.attention import triton_attention as ta
    gen = torch.Generator().manual_seed(3)
    contexts = torch.randint(1, 3000 if DEVICE == "cuda" else 300, (24 if DEVICE == "cuda" else 4,), generator=gen).tolist()
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        n = len(contexts)
        for query_lens, label in (([1] * n, "decode"), ([1] * (n - 3) + [37, 1, 20], "mixed")):
            contexts_now = [max(c, q) for c, q in zip(contexts, query_lens)]
            batch = paged_batch("llama3-8b", contexts_now, query_lens, cache_dtype=cache_dtype, seed=5)
            batch.caches = batch.caches[:1]
            scales = torch.tensor([0.7, 1.3], device=DEVICE) if cache_dtype != torch.bfloat16 else None
            args = (batch.query, *batch.caches[0], batch.block_tables, batch.context_lens, batch.query_start_loc,
                    batch.max_query_len, batch.max_context_len, 128 ** -0.5)
            expected = reference.paged_attention(*args, kv_scales=scales).float()
            actual = ta.paged_attention(*args, kv_scales=scales).float()
            err = (actual - expected).abs().max().item()
            report(f"{'PASS' if err < 2e-2 else 'FAIL'} closeness {label} cache={cache_dtype} max|diff|={err:.2e}")


def check_fp8_writes(report) -> None:
    """The fused attention-inputs kernel and the plain cache write into an fp8 cache, against torch."""
    from hearth_llm.kernels.attention_inputs import reference as inputs_reference
    from hearth_llm.kernels.attention_inputs import triton_attention_inputs
    from hearth_llm.kernels.kv_cache import reference as cache_reference
    from hearth_llm.kernels.kv_cache import triton_kv_cache
    gen = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, head_dim, tokens = 16, 8, 128, 300
    qkv = (3 * torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)).to(DEVICE, torch.bfloat16)
    positions = torch.randint(0, 4000, (tokens,), generator=gen).to(DEVICE)
    cos_sin = torch.randn(4096, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    norms = [(torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE, torch.bfloat16) for _ in range(2)]
    slots = torch.randperm(64 * 16, generator=gen)[:tokens].to(DEVICE)
    scales = torch.tensor([0.05, 0.01], device=DEVICE)
    caches = [torch.zeros(64, 16, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(4)]
    triton_attention_inputs.qk_norm_rope_and_cache(qkv, positions, cos_sin, caches[0], caches[1], slots, num_heads,
                                                   num_kv_heads, *norms, kv_scales=scales)
    inputs_reference.qk_norm_rope_and_cache(qkv, positions, cos_sin, caches[2], caches[3], slots, num_heads,
                                            num_kv_heads, *norms, 1e-6, True, scales)
    for name, actual, expected in (("keys", caches[0], caches[2]), ("values", caches[1], caches[3])):
        equal = (actual.float() == expected.float()).float().mean().item()
        # the torch composition rounds norm and rotary to bf16 on its own: a bf16 step apart, scaled
        diff = (actual.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()
        report(f"{'PASS' if equal > 0.99 else 'FAIL'} fp8 fused write {name}: "
               f"{equal * 100:.3f}% equal to torch, max |diff| / max |value| {diff:.4f}")
    key = (20 * torch.randn(tokens, num_kv_heads, head_dim, generator=gen)).to(DEVICE, torch.bfloat16)
    for cache in caches:
        cache.zero_()
    triton_kv_cache.write_kv_cache(key, key, caches[0], caches[1], slots, scales)
    cache_reference.write_kv_cache(key, key, caches[2], caches[3], slots, scales)
    equal = (caches[0].float() == caches[2].float()).float().mean().item()
    report(f"{'PASS' if equal > 0.995 else 'FAIL'} fp8 write_kv_cache: {equal * 100:.3f}% equal to torch, "
           f"saturated {(caches[2].float().abs() == 448).float().mean().item() * 100:.2f}%")


def engine_throughput(shape: str, variants: list[str], report, num_seqs: int = 256) -> None:
    """The benchmark workload (``num_seqs`` sequences, prompt and output U[100,1024]) through the
    engine once per variant: ``auto`` (bf16 cache), ``fp8`` (an e4m3 cache); ``auto:N64/w4/s2/p8/min256[/nodot]``
    runs the decode kernel with that launch."""
    import gc

    from hearth_llm.engine.config import EngineConfig
    from hearth_llm.engine.llm_engine import LLMEngine
    from hearth_llm.kernels.attention import triton_attention as ta

    from .throughput import random_checkpoint, run_ours
    from .workloads import workload
    _, checkpoint = random_checkpoint(shape, torch.bfloat16, DEVICE)
    requests = workload(num_seqs) if DEVICE == "cuda" else workload(num_seqs, low=10, high=40)
    default_launch = ta.DEFAULT_LAUNCH
    for variant in variants:
        kv_dtype, _, launch = variant.partition(":")
        if launch:
            ta.DEFAULT_LAUNCH = _parse_launch(launch)
        try:
            config = EngineConfig(model=checkpoint.source, dtype="bfloat16", device=DEVICE, max_num_seqs=256,
                                  max_num_batched_tokens=16384, kv_cache_memory="40GiB" if DEVICE == "cuda" else "64MiB",
                                  max_model_len=4096,
                                  show_progress=False, kv_cache_dtype=kv_dtype)
            engine = LLMEngine(config, checkpoint=checkpoint)
            result = run_ours(engine, requests)
            report(f"engine {shape} {variant}: {result['tok_per_s']:.0f} tok/s, {result['seconds']:.2f} s, "
                   f"steps {result['steps']}, p50 step {result['step_ms_p50']:.2f} ms, blocks {engine.runner.num_blocks}")
        finally:
            ta.DEFAULT_LAUNCH = default_launch
            engine = None
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


def _parse_launch(text: str):
    """``N64/w4/s2/p8/min256[/nodot][/r128][/hf][/fp8N128]`` (as :func:`_describe` prints it) -> DecodeLaunch."""
    from hearth_llm.kernels.attention.triton_attention import DecodeLaunch
    fields = dict(use_dot=True)
    for part in text.split("/"):
        if part == "nodot":
            fields["use_dot"] = False
        elif part == "hf":
            fields["heads_fastest"] = True
        elif part.startswith("fp8N"):
            fields["fp8_block_n"] = int(part[4:])
        elif part.startswith("min"):
            fields["min_split_tokens"] = int(part[3:])
        else:
            fields[{"N": "block_n", "w": "num_warps", "s": "num_stages", "p": "programs_per_sm",
                    "r": "maxnreg"}[part[0]]] = int(part[1:])
    return DecodeLaunch(**fields)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget-s", type=float, default=80.0)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny cases on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--engine", nargs="+", metavar="VARIANT",
                        help="instead of the kernel sweep: the engine's throughput per variant (auto, fp8, "
                             "auto:N64/w4/s2/p8/min256)")
    parser.add_argument("--shape", default="qwen3-0.6b", help="with --engine")
    parser.add_argument("--routed", action="store_true",
                        help="instead of the sweep: the engine's prefill attention, Triton vs long prefills on "
                             "FlashAttention-2, on long-context and workload steps")
    parser.add_argument("--long-mix", nargs="+", metavar="on|off|cudnn", choices=("on", "off", "cudnn"),
                        help="instead of the sweep: the long-context mix through the engine (--shape), once per "
                             "mode (flash on / off / fresh prompts on cuDNN), with prefill and decode steps' device time")
    parser.add_argument("--long-mix-requests", type=int, default=None, help="with --long-mix: fewer requests")
    parser.add_argument("--quick", action="store_true",
                        help="a few decode launches, the fp8 dot A/B and two prefill tiles (round-2 confirmation)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = "cpu" if args.smoke else "cuda"
    if args.engine:
        engine_throughput(args.shape, args.engine, lambda line: print(line, flush=True), 256 if not args.smoke else 4)
        return
    began = time.perf_counter()

    def report(line):
        print(f"[{time.perf_counter() - began:5.1f}s] {line}", flush=True)

    if args.routed:
        routed_prefill_comparison(report, args.budget_s)
        return
    if args.long_mix:
        long_mix(args.shape, report, args.long_mix, args.long_mix_requests)
        return

    def out_of_time(fraction=1.0):
        return time.perf_counter() - began > args.budget_s * fraction

    torch.backends.cuda.matmul.allow_tf32 = True
    if not args.smoke:
        report(f"device {torch.cuda.get_device_name()} SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    if args.check:
        check_closeness(report)
        check_fp8_writes(report)
    default_launch, variants = decode_variants()
    if args.smoke:
        variants = variants[:1]
    if args.quick:
        from hearth_llm.kernels.attention.triton_attention import DecodeLaunch
        variants = [(f"new {_describe(launch)}", launch) for launch in
                    (DecodeLaunch(64, 4, 3), DecodeLaunch(64, 4, 4), DecodeLaunch(32, 4, 3), DecodeLaunch(64, 8, 3))]
    best_tiles: dict[str, tuple[float, object]] = {}
    cases = decode_cases(args.smoke)
    # Every case's batch at once (~10 GB), so each variant compiles once and runs on all of them.
    batches = [paged_batch(shape, contexts, [1] * len(contexts)) for shape, _, contexts in cases]
    baseline_us = [run_decode(batch, default_launch, 4096 if batch.max_context_len <= 4096 else None)
                   for batch in batches]
    results: dict[int, list] = {index: [] for index in range(len(cases))}
    for name, launch in [("new default " + _describe(default_launch), default_launch)] + variants:
        if out_of_time(0.42):
            report("  (out of time: later decode variants skipped)")
            break
        cells = []
        for index, ((shape, label, _), batch) in enumerate(zip(cases, batches)):
            us = run_decode(batch, launch, graph_max_context_len=4096 if batch.max_context_len <= 4096 else None)
            results[index].append((us, name, launch))
            cells.append(f"{label}/{shape}: {us:.1f}us {_gbs(batch, us):.0f}GB/s {baseline_us[index] / us:.2f}x the default")
        report(f"{name} | " + " | ".join(cells))
    for index, ((shape, label, _), batch) in enumerate(zip(cases, batches)):
        if results[index]:
            best = min(results[index], key=lambda r: r[0])
            best_tiles[label + shape] = best
            report(f"BEST decode {shape} {label}: {best[1]} {best[0]:.1f}us {_gbs(batch, best[0]):.0f}GB/s "
                   f"({baseline_us[index] / best[0]:.2f}x the default)")
    del batches
    torch.cuda.empty_cache()

    # Split policy around the most common best tile, on the shapes it matters for.
    if best_tiles and not args.quick and not out_of_time(0.45):
        from collections import Counter
        tile = Counter((b[2].block_n, b[2].num_warps, b[2].num_stages, b[2].use_dot)
                       for b in best_tiles.values()).most_common(1)[0][0]
        from hearth_llm.kernels.attention.triton_attention import DecodeLaunch
        report(f"split sweep on tile N{tile[0]}/w{tile[1]}/s{tile[2]} use_dot={tile[3]}")
        for shape, label, contexts in [cases[0], cases[1], cases[4], cases[6]] if not args.smoke else cases:
            batch = paged_batch(shape, contexts, [1] * len(contexts))
            for programs in (2, 4, 16, 32)[:1 if args.smoke else 4]:
                for min_tokens in (128, 512)[:1 if args.smoke else 2]:
                    if out_of_time(0.52):
                        break
                    launch = DecodeLaunch(*tile[:3], programs_per_sm=programs, min_split_tokens=min_tokens,
                                          use_dot=tile[3])
                    us = run_decode(batch, launch, 4096 if batch.max_context_len <= 4096 else None)
                    report(f"  {shape} {label} {_describe(launch)}: {us:.1f}us "
                           f"{batch.kv_bytes / (us * 1e-6) / 1e9:.0f}GB/s")
            del batch
            torch.cuda.empty_cache()

    # fp8 cache: the same decode at half the bytes.
    if not out_of_time(0.55):
        shape, label, contexts = cases[0]
        batch = paged_batch(shape, contexts, [1] * len(contexts), cache_dtype=torch.float8_e4m3fn)
        from hearth_llm.kernels.attention.triton_attention import DecodeLaunch
        fp8_launches = [("default (dot in fp16)", default_launch),
                        ("dot in bf16", dataclasses.replace(default_launch, fp8_dot_in_fp16=False))]
        fp8_launches += [v for v in variants if v[1].block_n >= 64][:2]
        for name, launch in fp8_launches:
            if out_of_time(0.6):
                break
            us = run_decode(batch, launch, 4096)
            report(f"fp8 decode {shape} {label} {name}: {us:.1f}us {batch.kv_bytes / (us * 1e-6) / 1e9:.0f}GB/s "
                   f"(of fp8 bytes)")
        del batch

    if not args.skip_prefill and not out_of_time(0.62):
        prefill_cases = [("llama3-8b", "smoke", [300, 40], [100, 40])] if args.smoke else [
            ("llama3-8b", "chunk 2048 of 8192", [8192], [2048]),
            ("llama3-8b", "30 prompts U[100,1024]", torch.randint(100, 1025, (30,)).tolist(), None),
        ]
        for shape, label, contexts, query_lens in prefill_cases:
            batch = paged_batch(shape, contexts, query_lens or contexts)
            prefill_launches = [(64, 32, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 2), (64, 64, 4, 2),
                                (128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 2)]
            if args.quick:
                prefill_launches = [(64, 32, 4, 2), (128, 64, 4, 2), (128, 64, 4, 3), (128, 32, 4, 2)]
            for block_m, block_n, warps, stages in prefill_launches[:1 if args.smoke else None]:
                if out_of_time():
                    report("  (out of time: prefill variants skipped)")
                    break
                us = run_prefill(batch, block_m, block_n, warps, stages)
                report(f"prefill {shape} {label} M{block_m}/N{block_n}/w{warps}/s{stages}: {us:.1f}us "
                       f"{batch.flops / (us * 1e-6) / 1e12:.1f}TFLOP/s")
            del batch
    report("done")


if __name__ == "__main__":
    main()
