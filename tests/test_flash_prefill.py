"""Long prefills on FlashAttention-2 (kernels/attention/flash_prefill.py): the per-step plan, and the
routed attention against the torch reference over the whole batch. On the CPU the varlen forward is
a plain-torch stand-in (FlashAttention exists only on CUDA); on CUDA the real op, in bf16."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from hearth_llm.kernels.attention import flash_prefill, reference

BLOCK_SIZE = 16


def to_device_of(device):
    return lambda arrays: [torch.as_tensor(np.asarray(a, dtype=np.int64)).to(device) for a in arrays]


def paged_step(query_lens, context_lens, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
               device="cpu", seed=0):
    """A step's queries and a paged cache whose blocks are shuffled, with the host lengths and table."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // BLOCK_SIZE) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    table = np.zeros((len(context_lens), max(blocks_per_seq)), dtype=np.int64)
    for seq, n in enumerate(blocks_per_seq):
        table[seq, :n] = [order.pop() for _ in range(n)]
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    step = dict(
        query=torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(device, dtype),
        key_cache=(2 * torch.randn(cache_shape, generator=generator)).to(device, dtype),
        value_cache=torch.randn(cache_shape, generator=generator).to(device, dtype),
        block_tables=torch.as_tensor(table).to(device),
        context_lens=torch.tensor(context_lens, device=device),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(device),
        max_query_len=max(query_lens), max_context_len=max(context_lens), scale=head_dim ** -0.5,
    )
    return step, table


def varlen_stand_in(query, key, value, cu_seqlens_q, cu_seqlens_k, max_query_len, max_context_len, scale,
                    sliding_window):
    """What FlashAttention's varlen forward computes (causal, bottom-right, GQA), one sequence at a time."""
    outs = []
    for seq in range(len(cu_seqlens_q) - 1):
        q = query[cu_seqlens_q[seq]:cu_seqlens_q[seq + 1]].transpose(0, 1)
        k = key[cu_seqlens_k[seq]:cu_seqlens_k[seq + 1]].transpose(0, 1)
        v = value[cu_seqlens_k[seq]:cu_seqlens_k[seq + 1]].transpose(0, 1)
        query_pos = torch.arange(k.shape[1] - q.shape[1], k.shape[1])[:, None]
        key_pos = torch.arange(k.shape[1])[None, :]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), scale=scale,
                                                   enable_gqa=True).transpose(0, 1))
    return torch.cat(outs)


def routed(step, table, sliding_window=None, varlen_attention=varlen_stand_in, min_query_len=8, min_context_len=0):
    query_lens = torch.diff(step["query_start_loc"]).tolist()
    plan = flash_prefill.plan_flash_prefill(query_lens, step["context_lens"].tolist(), table, BLOCK_SIZE,
                                            to_device_of(step["query"].device), min_query_len=min_query_len,
                                            min_context_len=min_context_len)
    out = flash_prefill.paged_attention(step["query"], step["key_cache"], step["value_cache"], plan, step["scale"],
                                        sliding_window, attend_rest=reference.paged_attention,
                                        varlen_attention=varlen_attention)
    return plan, out


def expected(step, sliding_window=None):
    return reference.paged_attention(step["query"], step["key_cache"], step["value_cache"], step["block_tables"],
                                     step["context_lens"], step["query_start_loc"], step["max_query_len"],
                                     step["max_context_len"], step["scale"], sliding_window)


def plan(query_lens, context_lens, table, min_query_len=8, min_context_len=50):
    return flash_prefill.plan_flash_prefill(query_lens, context_lens, table, BLOCK_SIZE, to_device_of("cpu"),
                                            min_query_len=min_query_len, min_context_len=min_context_len)


def test_a_long_chunk_over_a_long_context_takes_every_multi_token_sequence_along():
    table = np.arange(16).reshape(4, 4)
    step = plan([1, 40, 5, 1], [30, 60, 9, 12], table)  # 40 over 60 keys is the anchor; 5 joins it
    assert step.query_rows == slice(1, 46)
    assert step.cu_seqlens_q.tolist() == [0, 40, 45] and step.cu_seqlens_k.tolist() == [0, 60, 69]
    assert step.cu_seqlens_q.dtype == torch.int32
    assert step.key_slots.tolist() == list(range(4 * BLOCK_SIZE, 4 * BLOCK_SIZE + 60)) + list(range(128, 137))
    (decode,) = step.rest  # the single-token sequences, as a batch of their own
    assert decode.token_rows.tolist() == [0, 46] and decode.context_lens.tolist() == [30, 12]
    assert decode.block_tables.tolist() == [[0, 1, 2, 3], [12, 13, 14, 15]]
    assert decode.query_start_loc.tolist() == [0, 1, 2]
    assert (decode.max_query_len, decode.max_context_len, step.num_tokens) == (1, 30, 47)


def test_no_plan_without_an_anchor_or_when_disabled(monkeypatch):
    table = np.arange(8).reshape(2, 4)
    assert plan([1, 1], [20, 9], table) is None
    assert plan([40, 30], [40, 30], table) is None  # many new tokens, but over short contexts
    assert plan([7, 1], [60, 9], table) is None  # a long context, but few new tokens
    monkeypatch.setattr(flash_prefill, "ENABLED", False)
    assert plan([40, 1], [60, 9], table) is None


def test_plan_caps_the_keys_it_gathers(monkeypatch):
    monkeypatch.setattr(flash_prefill, "FLASH_MAX_GATHERED_KEYS", 100)
    table = np.arange(21).reshape(3, 7)
    step = plan([5, 50, 9], [100, 50, 9], table)  # the anchor first, then whoever still fits
    assert step.cu_seqlens_k.tolist() == [0, 50] and step.query_rows == slice(5, 55)
    (left_out,) = step.rest  # the 5-token sequence over 100 keys did not fit; 9 over 9 neither
    assert left_out.token_rows.tolist() == [0, 1, 2, 3, 4] + list(range(55, 64))
    assert left_out.max_query_len == 9 and left_out.max_context_len == 100


def test_plan_gathers_keys_in_position_order_across_shuffled_blocks():
    table = np.array([[7, 2, 5]])
    step = plan([10], [40], table, min_context_len=40)
    slots = step.key_slots.tolist()
    assert slots[:16] == list(range(7 * 16, 8 * 16)) and slots[16:32] == list(range(2 * 16, 3 * 16))
    assert slots[32:] == list(range(5 * 16, 5 * 16 + 8)) and step.rest == ()


@pytest.mark.parametrize("query_lens, context_lens", [
    ([40, 33], [40, 33]),                       # fresh prompts only
    ([1, 1, 50, 1], [70, 3, 120, 41]),          # a chunk over cached keys among decode rows
    ([20, 1, 9, 2, 64], [20, 30, 100, 2, 64]),  # routed sequences apart: their rows are gathered too
])
def test_routed_attention_equals_the_reference_over_the_whole_batch(query_lens, context_lens):
    step, table = paged_step(query_lens, context_lens)
    plan, out = routed(step, table)
    assert plan is not None
    torch.testing.assert_close(out, expected(step), atol=1e-5, rtol=1e-5)


def test_routed_attention_with_sequences_the_gather_cap_left_out(monkeypatch):
    monkeypatch.setattr(flash_prefill, "FLASH_MAX_GATHERED_KEYS", 150)
    step, table = paged_step([1, 1, 50, 1, 30], [70, 3, 120, 41, 90])
    plan, out = routed(step, table)
    assert [group.max_query_len for group in plan.rest] == [1, 30]  # decode rows; the 30 that did not fit
    torch.testing.assert_close(out, expected(step), atol=1e-5, rtol=1e-5)


def test_routed_attention_keeps_the_sliding_window():
    step, table = paged_step([1, 48, 12], [90, 80, 12])
    _, out = routed(step, table, sliding_window=24)
    torch.testing.assert_close(out, expected(step, sliding_window=24), atol=1e-5, rtol=1e-5)


def test_flash_is_not_used_on_cpu_or_for_layers_it_cannot_run():
    assert not flash_prefill.is_usable(torch.device("cpu"), torch.bfloat16, torch.bfloat16)
    cache = torch.zeros(2, BLOCK_SIZE, 1, 64, dtype=torch.bfloat16)
    query = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    assert not flash_prefill.supports(query, cache, cache, None, None)  # a CPU query
    if torch.cuda.is_available():
        query, cache = query.cuda(), cache.cuda()
        assert flash_prefill.supports(query, cache, cache, None, None)
        assert not flash_prefill.supports(query, cache, cache, 30.0, None)  # a soft cap
        fp8 = cache.to(torch.float8_e4m3fn)
        assert not flash_prefill.supports(query, fp8, fp8, None, torch.ones(2, device="cuda"))
        assert not flash_prefill.supports(query, cache[:, :8], cache[:, :8], None, None)  # slots not flat


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention runs on CUDA only")
@pytest.mark.parametrize("sliding_window", [None, 100])
def test_flash_attention_on_cuda_is_close_to_the_reference_in_bf16(sliding_window):
    step, table = paged_step([1, 300, 1, 200, 7], [900, 812, 5, 200, 40], num_heads=32, num_kv_heads=8,
                             head_dim=128, dtype=torch.bfloat16, device="cuda")
    _, out = routed(step, table, sliding_window, varlen_attention=flash_prefill.flash_varlen_attention,
                    min_query_len=128, min_context_len=500)  # 300 over 812 keys anchors; 200 and 7 join
    want = expected(step, sliding_window)
    assert (out.float() - want.float()).abs().max().item() < 2e-2


def test_a_refusing_op_turns_the_routing_off_with_a_warning(monkeypatch):
    from hearth_llm.engine.models.attention import AttentionMetadata, paged_attention

    step, table = paged_step([1, 40], [30, 40])
    plan, _ = routed(step, table)
    meta = AttentionMetadata(slot_mapping=None, block_tables=step["block_tables"], context_lens=step["context_lens"],
                             query_start_loc=step["query_start_loc"], max_query_len=40, max_context_len=40,
                             flash_prefill=plan)

    def refuse(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports ...")

    monkeypatch.setattr(flash_prefill, "supports", lambda *args: True)
    monkeypatch.setattr(flash_prefill, "flash_varlen_attention", refuse)
    monkeypatch.setattr(flash_prefill.paged_attention, "__defaults__", (refuse, refuse))
    monkeypatch.setattr(flash_prefill, "ENABLED", True)
    with pytest.warns(RuntimeWarning, match="FlashAttention-2 prefill disabled"):
        out = paged_attention(step["query"], step["key_cache"], step["value_cache"], meta, step["scale"], None, None,
                              None)
    assert flash_prefill.ENABLED is False
    torch.testing.assert_close(out, expected(step), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention runs on CUDA only")
def test_engine_with_long_prefills_on_flash_keeps_the_top5_rule_against_triton(monkeypatch):
    from hearth_llm.benchmarks.attention_kernels import top5_check
    from hearth_llm.benchmarks.throughput import our_engine, random_checkpoint

    monkeypatch.setattr(flash_prefill, "FLASH_MIN_QUERY_LEN", 256)  # anchors at these small sizes
    monkeypatch.setattr(flash_prefill, "FLASH_MIN_CONTEXT_LEN", 256)
    _, checkpoint = random_checkpoint("qwen3-0.6b", torch.bfloat16, "cuda", max_model_len=2048)
    engine = our_engine(checkpoint, "bfloat16", max_num_seqs=16, kv_cache_memory="2GiB", max_model_len=2048,
                        max_num_batched_tokens=1024)  # the 1,500-token prompt is chunked: a chunk over cached keys
    lines = []
    top5_check(engine, lines.append, prompt_lens=(5, 40, 130, 300, 1500), num_tokens=16)
    assert lines[0].startswith("PASS"), lines[0]


def fresh_on_math(query, key, value, lens, scale):
    """cudnn_fresh_attention itself (per-sequence calls, padding, GQA in place) on SDPA's math backend."""
    return flash_prefill.cudnn_fresh_attention(query, key, value, lens, scale, backends=(SDPBackend.MATH,))


@pytest.fixture
def cudnn_on(monkeypatch):
    """The cuDNN route on (CUDNN_FRESH), whatever its default."""
    monkeypatch.setattr(flash_prefill, "CUDNN_FRESH", True)


def routed_fresh(step, table, fresh=fresh_on_math, min_query_len=10, min_context_len=0):
    query_lens = torch.diff(step["query_start_loc"]).tolist()
    plan = flash_prefill.plan_flash_prefill(query_lens, step["context_lens"].tolist(), table, BLOCK_SIZE,
                                            to_device_of(step["query"].device), min_query_len=min_query_len,
                                            min_context_len=min_context_len, use_cudnn=True)
    out = flash_prefill.paged_attention(step["query"], step["key_cache"], step["value_cache"], plan, step["scale"],
                                        None, attend_rest=reference.paged_attention,
                                        varlen_attention=varlen_stand_in, fresh_attention=fresh)
    return plan, out


def test_a_cudnn_plan_runs_short_continuations_as_decode_rows_and_marks_fresh_steps(cudnn_on):
    table = np.arange(16).reshape(4, 4)
    step = flash_prefill.plan_flash_prefill([1, 40, 5, 1], [30, 40, 60, 12], table, BLOCK_SIZE, to_device_of("cpu"),
                                            min_query_len=8, min_context_len=30, use_cudnn=True)
    assert step.is_fresh and step.query_rows == slice(1, 41) and step.cu_seqlens_k.tolist() == [0, 40]
    assert step.fresh_lens == (40,)
    (decode,) = step.rest  # seq 0, the 5 tokens of seq 2 (each a row seeing one more key), seq 3
    assert decode.token_rows.tolist() == [0, 41, 42, 43, 44, 45, 46]
    assert decode.context_lens.tolist() == [30, 56, 57, 58, 59, 60, 12]
    assert decode.block_tables.tolist() == [[0, 1, 2, 3]] + [[8, 9, 10, 11]] * 5 + [[12, 13, 14, 15]]
    assert decode.query_start_loc.tolist() == list(range(8)) and decode.max_query_len == 1
    # the same step without cuDNN: the continuation joins FlashAttention-2, nothing is fresh
    old = plan([1, 40, 5, 1], [30, 40, 60, 12], table, min_context_len=30)
    assert not old.is_fresh and old.query_rows == slice(1, 46)
    longer = flash_prefill.plan_flash_prefill([40, 70], [40, 120], np.arange(16).reshape(2, 8), BLOCK_SIZE,
                                              to_device_of("cpu"), min_query_len=8, min_context_len=30,
                                              use_cudnn=True)
    assert not longer.is_fresh and longer.rest == ()  # 70 > CONTINUATION_AS_DECODE_ROWS: it stays routed


@pytest.mark.parametrize("pad", [256, 16, 1])
@pytest.mark.parametrize("query_lens, context_lens", [
    ([40, 33], [40, 33]),                       # fresh prompts only
    ([1, 1, 50, 1], [70, 3, 50, 41]),           # a fresh prompt among decode rows
    ([20, 1, 9, 2, 64], [20, 30, 100, 2, 64]),  # 9 over 100 keys becomes rows; the rest is fresh
    ([1, 70, 12, 40], [9, 120, 40, 40]),        # a long continuation: not fresh, the varlen op runs all
])
def test_cudnn_routed_attention_equals_the_reference(query_lens, context_lens, pad, cudnn_on, monkeypatch):
    monkeypatch.setattr(flash_prefill, "CUDNN_PAD_TOKENS", pad)
    step, table = paged_step(query_lens, context_lens)
    calls = []

    def fresh(*args):
        calls.append(list(args[3]))
        return fresh_on_math(*args)

    plan, out = routed_fresh(step, table, fresh)
    assert plan is not None and bool(calls) == plan.is_fresh
    assert plan.is_fresh == (70 not in query_lens)
    assert calls == ([[n for n, c in zip(query_lens, context_lens) if n == c and n > 1]] if plan.is_fresh else [])
    torch.testing.assert_close(out, expected(step), atol=1e-5, rtol=1e-5)


def test_a_refusing_cudnn_falls_back_to_flash_with_a_warning(cudnn_on):
    step, table = paged_step([1, 40], [30, 40])

    def refuse(*args):
        raise RuntimeError("cuDNN Frontend error: ...")

    with pytest.warns(RuntimeWarning, match="cuDNN attention for fresh prefills disabled"):
        plan, out = routed_fresh(step, table, refuse)
    assert plan.is_fresh and flash_prefill.CUDNN_FRESH is False
    torch.testing.assert_close(out, expected(step), atol=1e-5, rtol=1e-5)
    assert not flash_prefill.plan_flash_prefill([1, 40], [30, 40], table, BLOCK_SIZE, to_device_of("cpu"),
                                                min_query_len=8, min_context_len=0, use_cudnn=True).is_fresh


@pytest.mark.skipif(not (torch.cuda.is_available() and flash_prefill.is_cudnn_usable(torch.device("cuda"))),
                    reason="cuDNN attention on Hopper or newer only")
def test_cudnn_attention_on_cuda_is_close_to_the_reference_in_bf16(cudnn_on):
    step, table = paged_step([1, 300, 1, 200, 7, 30], [900, 300, 5, 200, 40, 900], num_heads=32, num_kv_heads=8,
                             head_dim=128, dtype=torch.bfloat16, device="cuda")
    calls = []

    def fresh(*args):
        calls.append(1)
        return flash_prefill.cudnn_fresh_attention(*args)

    plan, out = routed_fresh(step, table, fresh, min_query_len=128, min_context_len=250)
    assert plan.is_fresh and calls  # 300 anchors, 200 joins, both fresh; 7 over 40 and 30 over 900 as rows
    want = expected(step)
    assert (out.float() - want.float()).abs().max().item() < 2e-2
