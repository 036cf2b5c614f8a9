"""Each Triton kernel agrees with its plain-torch reference.

Without a GPU the kernels run on CPU tensors under the Triton interpreter, which is slow, so the
shapes here are small but cover the awkward cases (mixed batches, GQA, contexts that are not a
multiple of the block size, split decode, sliding windows). With a GPU the same tests run on
CUDA, and the tests marked ``needs_cuda`` add full-size shapes.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when it decorates kernels, its own library functions included, so it must be
    # set before triton is first imported. torch._dynamo imports triton too (transformers' model
    # imports reach it), so in a whole-suite run conftest.py has to set it before those imports.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; set it in tests/conftest.py "
                    "before any import of transformers or torch._dynamo", allow_module_level=True)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from hearth_llm.kernels import reference, sampling, triton_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="full-size shapes need a GPU")

# (atol, rtol) for comparing outputs of one dtype with the reference.
TOLERANCE = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    atol, rtol = TOLERANCE[dtype or expected.dtype]
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def randn(*shape, dtype=torch.float32, generator=None) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(device=DEVICE, dtype=dtype)


# --------------------------------------------------------------------------------------------
# A paged batch: sequences whose cached keys sit in shuffled blocks of a shared cache.
# --------------------------------------------------------------------------------------------


def make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, *, block_size=16,
                     dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-context_len // block_size) for context_len in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # Shuffled so a sequence's blocks are neither contiguous nor in order; one spare column
    # checks that tables wider than the context are fine.
    block_order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(query_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for seq, num_seq_blocks in enumerate(blocks_per_seq):
        block_tables[seq, :num_seq_blocks] = torch.tensor([block_order.pop() for _ in range(num_seq_blocks)])
    query_start_loc = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return dict(
        query=randn(sum(query_lens), num_heads, head_dim, dtype=dtype, generator=generator),
        key_cache=randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=generator),
        value_cache=randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=generator),
        block_tables=block_tables.to(DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        scale=head_dim**-0.5,
    )


def check_paged_attention(batch, dtype, sliding_window=None):
    expected = reference.paged_attention(**batch, sliding_window=sliding_window)
    actual = triton_ops.paged_attention(**batch, sliding_window=sliding_window)
    assert_close(actual, expected, dtype)


# Decoding (q_len 1), extending a cached prefix, and fresh prefills, with contexts that are not
# multiples of the block size and a query longer than one prefill tile.
MIXED_QUERY_LENS = [1, 5, 70, 1, 20]
MIXED_CONTEXT_LENS = [29, 45, 70, 97, 20]


# --------------------------------------------------------------------------------------------
# write_kv_cache
# --------------------------------------------------------------------------------------------


# Exact conversions only: the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest.
@pytest.mark.parametrize("key_dtype, cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_write_kv_cache_stores_strided_keys_at_their_slots(key_dtype, cache_dtype):
    num_tokens, num_kv_heads, head_dim = 7, 3, 32
    # Keys and values as views into a merged projection, as the attention layer makes them.
    merged = randn(num_tokens, 2 * num_kv_heads * head_dim + 8, dtype=key_dtype)
    key = merged[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = merged[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.tensor([3, 17, 0, 40, 41, 16, 63], device=DEVICE)
    caches = [torch.zeros(4, 16, num_kv_heads, head_dim, dtype=cache_dtype, device=DEVICE) for _ in range(4)]

    triton_ops.write_kv_cache(key, value, caches[0], caches[1], slot_mapping)
    reference.write_kv_cache(key, value, caches[2], caches[3], slot_mapping)

    assert torch.equal(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])


def test_write_kv_cache_skips_padding_slots():
    key, value = randn(5, 2, 16), randn(5, 2, 16)
    slot_mapping = torch.tensor([4, -1, 9, -1, 30], device=DEVICE)
    key_cache = torch.zeros(2, 16, 2, 16, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)

    triton_ops.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    is_real = slot_mapping >= 0
    expected_key, expected_value = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    reference.write_kv_cache(key[is_real], value[is_real], expected_key, expected_value, slot_mapping[is_real])
    assert torch.equal(key_cache, expected_key)
    assert torch.equal(value_cache, expected_value)


# --------------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_queries_per_kv", [1, 3])
def test_paged_attention_mixed_batch_matches_reference(num_queries_per_kv):
    batch = make_paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 2 * num_queries_per_kv, 2, 64)
    check_paged_attention(batch, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_mixed_batch_in_half_precision(dtype):
    batch = make_paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 6, 2, 64, dtype=dtype)
    check_paged_attention(batch, dtype)


def test_paged_attention_head_dim_128_and_empty_sequence():
    # A sequence with no new tokens (a padding row) must not disturb its neighbours.
    batch = make_paged_batch([3, 0, 17], [19, 5, 17], 4, 4, 128)
    check_paged_attention(batch, torch.float32)


def test_paged_attention_head_dim_not_a_power_of_two():
    batch = make_paged_batch([1, 9], [33, 9], 4, 2, 80)
    check_paged_attention(batch, torch.float32)


def test_paged_attention_block_size_not_the_key_tile():
    batch = make_paged_batch([4, 1], [100, 50], 3, 1, 32, block_size=8)
    check_paged_attention(batch, torch.float32)


@pytest.mark.parametrize("num_queries_per_kv", [1, 3])
def test_paged_attention_decode_splits_long_contexts_into_partitions(num_queries_per_kv):
    context_lens = [1300, 17, 2 * triton_ops.DECODE_MIN_PARTITION_SIZE]
    batch = make_paged_batch([1, 1, 1], context_lens, 2 * num_queries_per_kv, 2, 64)
    check_paged_attention(batch, torch.float32)


def test_paged_attention_decode_with_short_contexts_uses_one_partition():
    batch = make_paged_batch([1, 1, 1, 1], [1, 16, 33, 200], 6, 2, 64)
    check_paged_attention(batch, torch.float32)


def test_paged_attention_decode_in_bf16():
    batch = make_paged_batch([1, 1], [700, 40], 6, 2, 64, dtype=torch.bfloat16)
    check_paged_attention(batch, torch.bfloat16)


def test_paged_attention_sliding_window_in_mixed_batch():
    batch = make_paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 6, 2, 64)
    check_paged_attention(batch, torch.float32, sliding_window=24)


def test_paged_attention_sliding_window_in_split_decode():
    # The window starts mid-partition and spans two partitions; the short context fits inside it.
    batch = make_paged_batch([1, 1], [1300, 40], 4, 2, 64)
    check_paged_attention(batch, torch.float32, sliding_window=700)


def test_paged_attention_rejects_heads_not_divisible_by_kv_heads():
    batch = make_paged_batch([1], [4], 3, 2, 16)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        triton_ops.paged_attention(**batch)


# --------------------------------------------------------------------------------------------
# rms_norm, rotary_embedding, silu_and_mul
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_returns_normed_and_sum(dtype):
    x, residual = randn(2, 3, 96, dtype=dtype), randn(2, 3, 96, dtype=dtype)
    weight = randn(96, dtype=dtype)

    normed, summed = triton_ops.rms_norm(x, weight, 1e-6, residual)
    expected_normed, expected_summed = reference.rms_norm(x, weight, 1e-6, residual)

    assert_close(normed, expected_normed)
    assert_close(summed, expected_summed)


def test_rms_norm_without_residual_returns_input_as_sum():
    x, weight = randn(5, 64), randn(64)

    normed, summed = triton_ops.rms_norm(x, weight, 1e-5)

    assert_close(normed, reference.rms_norm(x, weight, 1e-5)[0])
    assert summed is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_of_strided_query_and_key(dtype):
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 4, 2, 32
    merged = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    query = merged[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    key = merged[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 50, 99, 7], device=DEVICE)
    cos_sin_cache = randn(100, head_dim)  # fp32, as the rotary layer keeps it

    actual_query, actual_key = triton_ops.rotary_embedding(query, key, positions, cos_sin_cache)
    expected_query, expected_key = reference.rotary_embedding(query, key, positions, cos_sin_cache)

    assert_close(actual_query, expected_query)
    assert_close(actual_key, expected_key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    x = randn(2, 3, 2 * 1500, dtype=dtype)  # more than one column block per row
    assert_close(triton_ops.silu_and_mul(x), reference.silu_and_mul(x))


# --------------------------------------------------------------------------------------------
# sample_from_logits: the Triton sampler and its torch reference follow the same rules.
# --------------------------------------------------------------------------------------------

SAMPLERS = {"reference": sampling.sample_from_logits, "triton": triton_ops.sample_from_logits}


def sample_rows(sampler, logits_row, num_rows, temperature=1.0, top_k=0, top_p=1.0, min_p=None, seed=0):
    logits = logits_row.to(DEVICE).expand(num_rows, -1).contiguous()
    full = lambda value, dtype: torch.full((num_rows,), value, dtype=dtype, device=DEVICE)  # noqa: E731
    generator = torch.Generator(DEVICE).manual_seed(seed)
    return SAMPLERS[sampler](
        logits, full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
        generator, None if min_p is None else full(min_p, torch.float32),
    )


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens.cpu(), minlength=vocab_size).float() / tokens.numel()


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sampler_greedy_rows_take_the_first_argmax(sampler):
    logits = randn(5, 300)
    logits[2, 7] = logits[2, 100] = 1e4  # a tie
    temperatures = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.7], device=DEVICE)
    top_ks = torch.tensor([0, 1, 5, 0, 1], device=DEVICE)
    top_ps = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0], device=DEVICE)

    tokens = SAMPLERS[sampler](logits, temperatures, top_ks, top_ps)

    # Greedy rows and top-k = 1 rows both take the argmax.
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert tokens[2].item() == 7


def test_triton_sampler_finds_the_argmax_across_vocabulary_splits():
    logits = randn(2, 9000)
    logits[0, 8000] = 100.0
    logits[1, 100] = logits[1, 8000] = 100.0  # a tie across two splits
    temperatures = torch.zeros(2, device=DEVICE)
    top_ks, top_ps = torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.ones(2, device=DEVICE)

    tokens = triton_ops.sample_from_logits(logits, temperatures, top_ks, top_ps)

    assert tokens.tolist() == [8000, 100]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sampler_draws_follow_softmax_of_tempered_logits(sampler):
    tokens = sample_rows(sampler, LOGITS, 4000, temperature=1.5)
    expected = torch.softmax(LOGITS / 1.5, -1)
    torch.testing.assert_close(frequencies(tokens, 6), expected, atol=0.03, rtol=0)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sampler_top_k_then_top_p_renormalizes_the_kept_tokens(sampler):
    # Top 3 are tokens 5, 0, 1 with renormalized probabilities 0.67, 0.24, 0.09: top_p 0.8 keeps 5 and 0.
    tokens = sample_rows(sampler, LOGITS, 2000, top_k=3, top_p=0.8)
    probs = torch.softmax(LOGITS, -1)
    expected = torch.zeros(6)
    expected[[5, 0]] = probs[[5, 0]] / probs[[5, 0]].sum()
    torch.testing.assert_close(frequencies(tokens, 6), expected, atol=0.04, rtol=0)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sampler_top_p_alone_keeps_the_nucleus(sampler):
    # Probabilities 0.61, 0.22, 0.08, ...: top_p 0.7 keeps tokens 5 and 0.
    tokens = sample_rows(sampler, LOGITS, 1000, top_p=0.7)
    assert set(tokens.tolist()) == {5, 0}


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sampler_min_p_drops_tokens_far_below_the_best(sampler):
    # min_p 0.3 keeps tokens within 0.3x of token 5's probability: 5 and 0 (e^-1 = 0.37).
    tokens = sample_rows(sampler, LOGITS, 1000, min_p=0.3)
    assert set(tokens.tolist()) == {5, 0}


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sampler_repeats_its_draws_for_the_same_generator_seed(sampler):
    first = sample_rows(sampler, LOGITS, 64, temperature=2.0, seed=3)
    again = sample_rows(sampler, LOGITS, 64, temperature=2.0, seed=3)
    other = sample_rows(sampler, LOGITS, 64, temperature=2.0, seed=4)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# --------------------------------------------------------------------------------------------
# Full-size shapes, on a GPU only.
# --------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_full_size_mixed_batch(dtype):
    query_lens = [1, 1, 1, 300, 1, 2048, 77, 1]
    context_lens = [4096, 1, 2500, 300, 17, 2048, 3000, 1025]
    batch = make_paged_batch(query_lens, context_lens, 32, 8, 128, dtype=dtype)
    check_paged_attention(batch, dtype)


@needs_cuda
@pytest.mark.parametrize("sliding_window", [None, 1000])
def test_paged_attention_full_size_decode_batch(sliding_window):
    context_lens = [4096, 1, 2500, 511, 513, 17, 3000, 1025] * 4
    batch = make_paged_batch([1] * len(context_lens), context_lens, 32, 8, 128, dtype=torch.bfloat16)
    check_paged_attention(batch, torch.bfloat16, sliding_window=sliding_window)


@needs_cuda
def test_paged_attention_full_size_fp32():
    batch = make_paged_batch([1, 513, 1], [4096, 1500, 1000], 32, 8, 128)
    check_paged_attention(batch, torch.float32)


@needs_cuda
def test_elementwise_kernels_full_size():
    x, residual, weight = randn(512, 4096, dtype=torch.bfloat16), randn(512, 4096, dtype=torch.bfloat16), randn(4096)
    for actual, expected in zip(triton_ops.rms_norm(x, weight, 1e-6, residual),
                                reference.rms_norm(x, weight, 1e-6, residual)):
        assert_close(actual, expected, torch.bfloat16)
    query, key = randn(512, 32, 128, dtype=torch.bfloat16), randn(512, 8, 128, dtype=torch.bfloat16)
    positions, cos_sin_cache = torch.randint(0, 4096, (512,), device=DEVICE), randn(4096, 128)
    for actual, expected in zip(triton_ops.rotary_embedding(query, key, positions, cos_sin_cache),
                                reference.rotary_embedding(query, key, positions, cos_sin_cache)):
        assert_close(actual, expected)
    gate_up = randn(512, 2 * 11008, dtype=torch.bfloat16)
    assert_close(triton_ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


@needs_cuda
def test_sampler_full_vocabulary_batch():
    logits = randn(64, 151_936)
    temperatures = torch.tensor([0.0, 0.7] * 32, device=DEVICE)
    top_ks = torch.tensor([0, 0, 50, 0] * 16, device=DEVICE)
    top_ps = torch.tensor([1.0, 1.0, 1.0, 0.9] * 16, device=DEVICE)
    tokens = triton_ops.sample_from_logits(logits, temperatures, top_ks, top_ps)
    assert tokens.shape == (64,) and tokens.dtype == torch.int64
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))
    top_50 = logits.topk(50, dim=-1).indices
    assert all(tokens[row] in top_50[row] for row in range(2, 64, 4))


# --------------------------------------------------------------------------------------------
# qk_norm_rope_and_cache: the fused kernel against the composition of the single ops
# --------------------------------------------------------------------------------------------


def fused_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, *, has_norm, seed=0):
    """(fused outputs, single-op outputs): the queries and both caches. Row 0 is a padding row
    (slot -1), which the single ops don't know: they run it alone against a scratch cache."""
    from hearth_llm import kernels

    generator = torch.Generator().manual_seed(seed)
    num_blocks, block_size = 8, 16
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, generator=generator)
    positions = torch.randint(0, 500, (num_tokens,), generator=generator).to(DEVICE)
    cos_sin_cache = randn(512, head_dim, dtype=dtype, generator=generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(DEVICE)
    slots[0] = -1
    norms = [randn(head_dim, dtype=dtype, generator=generator) for _ in range(2)] if has_norm else [None, None]
    key_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=generator)
    value_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=generator)

    fused_caches = key_cache.clone(), value_cache.clone()
    fused_query = triton_ops.qk_norm_rope_and_cache(qkv, positions, cos_sin_cache, *fused_caches, slots, num_heads,
                                                    num_kv_heads, *norms, 1e-6)
    caches = key_cache.clone(), value_cache.clone()
    query = kernels.qk_norm_rope_and_cache_unfused(qkv[1:], positions[1:], cos_sin_cache, *caches, slots[1:],
                                                   num_heads, num_kv_heads, *norms, 1e-6)
    padding_query = kernels.qk_norm_rope_and_cache_unfused(
        qkv[:1], positions[:1], cos_sin_cache, key_cache.clone(), value_cache.clone(), slots.new_zeros(1),
        num_heads, num_kv_heads, *norms, 1e-6)
    return (fused_query, *fused_caches), (torch.cat([padding_query, query]), *caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_norm", [False, True])
def test_qk_norm_rope_and_cache_matches_the_single_ops(dtype, has_norm):
    fused, unfused = fused_case(5, 6, 2, 32, dtype, has_norm=has_norm)
    for actual, expected in zip(fused, unfused):
        assert_close(actual, expected)


@needs_cuda
@pytest.mark.parametrize("num_heads, num_kv_heads, has_norm", [(16, 8, True), (32, 8, False)])
def test_qk_norm_rope_and_cache_full_size(num_heads, num_kv_heads, has_norm):
    fused, unfused = fused_case(100, num_heads, num_kv_heads, 128, torch.bfloat16, has_norm=has_norm)
    for actual, expected in zip(fused, unfused):
        assert_close(actual, expected)
