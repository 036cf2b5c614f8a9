"""The split-K decode attention kernel (kernels/attention/triton_attention.py) and fp8 caches in the
attention kernels, against the torch reference; on CPU under the Triton interpreter."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
pytest.importorskip("triton")

from hearth_llm.kernels.attention import reference  # noqa: E402
from hearth_llm.kernels.attention import triton_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def paged_batch(query_lens, context_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                cache_dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32)
    for seq, n in enumerate(blocks_per_seq):
        tables[seq, :n] = torch.tensor([order.pop() for _ in range(n)])
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(
        query=torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(DEVICE),
        key_cache=(3 * torch.randn(cache_shape, generator=generator)).to(DEVICE, cache_dtype),
        value_cache=torch.randn(cache_shape, generator=generator).to(DEVICE, cache_dtype),
        block_tables=tables.to(DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(DEVICE, torch.int32),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        scale=head_dim ** -0.5,
    )


def decode_with(batch, launch, max_context_len=None, sliding_window=None, soft_cap=None, kv_scales=None):
    """The decode kernel alone, with a chosen launch (paged_attention uses the default one)."""
    query = batch["query"]
    num_heads, head_dim = query.shape[1:]
    common = dict(num_queries_per_kv=num_heads // batch["key_cache"].shape[2], block_size=batch["key_cache"].shape[1],
                  head_dim=head_dim, softmax_scale_log2=batch["scale"] * 1.4426950408889634,
                  soft_cap_log2=(soft_cap or 1.0) * 1.4426950408889634, sliding_window=sliding_window or 0,
                  HAS_SLIDING_WINDOW=sliding_window is not None, HAS_SOFT_CAP=soft_cap is not None,
                  BLOCK_D=triton_attention.next_power_of_2(head_dim), DOT_IN_FP32=True)
    out = torch.empty_like(query)
    triton_attention.decode_attention(out, query, batch["key_cache"], batch["value_cache"], batch["block_tables"],
                                   batch["context_lens"], batch["query_start_loc"],
                                   max_context_len or batch["max_context_len"], kv_scales, common, launch)
    return out


def expected(batch, **options):
    return reference.paged_attention(**batch, **options)


SPLITTING = triton_attention.DecodeLaunch(block_n=16, min_split_tokens=32, max_splits=8)


@pytest.mark.parametrize("use_dot", [True, False])
def test_decode_cuts_each_context_by_its_own_length(use_dot):
    # 300 keys -> 7 pieces of 48; 20 keys -> one piece written directly; 90 keys -> 3 pieces.
    batch = paged_batch([1, 1, 1], [300, 20, 90])
    launch = triton_attention.DecodeLaunch(block_n=16, min_split_tokens=32, max_splits=8, use_dot=use_dot)
    torch.testing.assert_close(decode_with(batch, launch), expected(batch), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("use_dot,heads_fastest", [(True, False), (False, False), (True, True)])
def test_fused_merge_by_the_last_piece_matches_reference_and_leaves_counters_at_zero(use_dot, heads_fastest):
    # The same cuts as above, merged by each context's last piece instead of the reduce kernel; a
    # second launch on the same cache reuses the counters (they must be back at 0), with another split.
    # heads_fastest: the grid runs (KV heads, sequences, splits), and each (sequence, head) keeps its own counter.
    batch = paged_batch([1, 1, 1], [300, 20, 90], seed=4)
    launch = triton_attention.DecodeLaunch(block_n=16, min_split_tokens=32, max_splits=8, use_dot=use_dot,
                                           fused_reduce=True, heads_fastest=heads_fastest)
    torch.testing.assert_close(decode_with(batch, launch), expected(batch), atol=2e-5, rtol=1e-5)
    counters = triton_attention._merge_counters(batch["key_cache"], 1)
    assert int(counters.abs().sum()) == 0
    fewer = triton_attention.DecodeLaunch(block_n=16, min_split_tokens=64, max_splits=4, use_dot=use_dot,
                                          fused_reduce=True, heads_fastest=heads_fastest)
    torch.testing.assert_close(decode_with(batch, fewer), expected(batch), atol=2e-5, rtol=1e-5)
    assert int(counters.abs().sum()) == 0


def test_decode_split_for_a_longer_graph_context_reads_only_the_real_keys():
    # A CUDA graph is captured for max_model_len: splits beyond a context's own keys do nothing.
    batch = paged_batch([1, 1], [70, 33])
    torch.testing.assert_close(decode_with(batch, SPLITTING, max_context_len=4096), expected(batch),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("use_dot", [True, False])
def test_decode_split_with_sliding_window_and_soft_cap(use_dot):
    batch = paged_batch([1, 1], [260, 40])
    launch = triton_attention.DecodeLaunch(block_n=16, min_split_tokens=32, max_splits=4, use_dot=use_dot)
    torch.testing.assert_close(decode_with(batch, launch, sliding_window=100, soft_cap=5.0),
                               expected(batch, sliding_window=100, soft_cap=5.0), atol=2e-5, rtol=1e-5)


def test_decode_skips_padding_sequences_and_leaves_their_rows_alone():
    batch = paged_batch([1, 0, 1], [50, 1, 120])
    batch["query"] = batch["query"][:2]
    out = decode_with(batch, SPLITTING)
    torch.testing.assert_close(out, expected(batch), atol=2e-5, rtol=1e-5)


def test_split_count_follows_batch_and_sm_count_not_context():
    device = torch.device("cpu")
    launch = triton_attention.DEFAULT_LAUNCH
    assert triton_attention.num_decode_splits(256, 8, 4096, device, launch) == 1
    assert triton_attention.num_decode_splits(1, 8, 8192, device, launch) == 32  # 8192 keys hold 32 pieces of 256
    assert triton_attention.num_decode_splits(1, 8, 300, device, launch) == 2  # 300 keys hold two 256-key pieces
    assert 1 < triton_attention.num_decode_splits(32, 8, 8192, device, launch) <= launch.max_splits


@pytest.mark.parametrize("query_lens, context_lens", [([1, 1, 1], [300, 20, 90]), ([1, 7, 30], [40, 7, 61])])
def test_fp8_cache_is_read_with_its_scales(query_lens, context_lens):
    batch = paged_batch(query_lens, context_lens, cache_dtype=FP8)
    scales = torch.tensor([0.5, 2.0], device=DEVICE)
    want = expected(batch, kv_scales=scales)
    # the same attention over the dequantized cache, as an fp32 cache
    dequantized = dict(batch, key_cache=batch["key_cache"].float() * 0.5, value_cache=batch["value_cache"].float() * 2)
    torch.testing.assert_close(want, reference.paged_attention(**dequantized), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(triton_attention.paged_attention(**batch, kv_scales=scales), want,
                               atol=2e-5, rtol=1e-5)


def test_fp8_split_decode_without_dot_matches_reference():
    batch = paged_batch([1, 1], [300, 20], cache_dtype=FP8)
    scales = torch.tensor([1.5, 0.25], device=DEVICE)
    launch = triton_attention.DecodeLaunch(block_n=16, min_split_tokens=32, max_splits=8, use_dot=False)
    torch.testing.assert_close(decode_with(batch, launch, kv_scales=scales), expected(batch, kv_scales=scales),
                               atol=2e-5, rtol=1e-5)


def test_kv_scales_are_refused_for_an_unquantized_cache_and_in_a_wrong_shape():
    batch = paged_batch([1], [20])
    with pytest.raises(ValueError, match="kv_scales"):
        triton_attention.paged_attention(**batch, kv_scales=torch.ones(2, device=DEVICE))
    fp8_batch = paged_batch([1], [20], cache_dtype=FP8)
    with pytest.raises(ValueError, match="kv_scales"):
        triton_attention.paged_attention(**fp8_batch, kv_scales=torch.ones(3, device=DEVICE))


@pytest.mark.parametrize("query_lens, context_lens", [([1, 1, 1], [300, 20, 90]), ([1, 7, 30], [40, 7, 61])])
def test_fp8_cache_with_bf16_queries(query_lens, context_lens):
    # On CUDA the dots run in fp16 (fp8 -> fp16 is one instruction per pair); bf16 tolerances.
    batch = paged_batch(query_lens, context_lens, cache_dtype=FP8)
    batch["query"] = batch["query"].bfloat16()
    scales = torch.tensor([0.5, 2.0], device=DEVICE)
    torch.testing.assert_close(triton_attention.paged_attention(**batch, kv_scales=scales).float(),
                               expected(batch, kv_scales=scales).float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("query_scale", [1.0, 12.0])  # 12: scores spread wide, the max moves often
@pytest.mark.parametrize("sliding_window", [None, 40])
def test_prefill_with_lazy_rescale_matches_reference(monkeypatch, query_scale, sliding_window):
    # Chunks over cached keys beside a fresh prompt and a decode row (prefill kernel, several key tiles).
    batch = paged_batch([30, 1, 45], [100, 70, 45])
    batch["query"] = batch["query"] * query_scale
    monkeypatch.setattr(triton_attention, "PREFILL_LAZY_RESCALE", True)
    torch.testing.assert_close(triton_attention.paged_attention(**batch, sliding_window=sliding_window),
                               expected(batch, sliding_window=sliding_window), atol=2e-5, rtol=1e-5)
