"""The kernel ops the newer architectures need, on every path (reference, CPU, Triton):

- attention logit soft-capping (Gemma 2),
- partial rotary (Phi-3/4-mini) and GPT-J style interleaved rotary (Cohere),
- GeGLU and plain GELU (Gemma, StarCoder2),
- LayerNorm with and without bias (Cohere, StarCoder2),
- ``sample_rows``, the engine's sampling math, which never reads the device.

Each reference is first checked against HF transformers' own formula for it (float32), then the
CPU routines and the Triton kernels against the reference. Without a GPU the Triton kernels run on
CPU tensors under the interpreter, so shapes are small; ``needs_cuda`` tests add full-size shapes.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# test_kernels sets TRITON_INTERPRET before triton loads (or skips when it cannot) and holds the
# paged-batch builder and the per-dtype tolerances; this file follows the same rules.
from test_kernels import DEVICE, assert_close, make_paged_batch, needs_cuda, randn  # noqa: E402

from hearth_llm import kernels  # noqa: E402
from hearth_llm.kernels import cpu_ops, reference, triton_ops  # noqa: E402
from hearth_llm.kernels.sampling import cpu as cpu_sampling, reference as reference_sampling  # noqa: E402
from hearth_llm.kernels.sampling import triton_sampling as triton_ops_sampling  # noqa: E402

IMPLEMENTATIONS = {"cpu": cpu_ops, "triton": triton_ops}
LOGITS_ROW = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])


def on_cpu(batch: dict) -> dict:
    return {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in batch.items()}


# --------------------------------------------------------------------------------------------
# paged_attention with soft_cap
# --------------------------------------------------------------------------------------------


def hf_gemma2_attention(batch, soft_cap, sliding_window=None):
    """Each sequence alone through HF Gemma 2's eager attention, keys gathered from the paged cache."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    batch = on_cpu(batch)
    query, key_cache, value_cache = batch["query"], batch["key_cache"], batch["value_cache"]
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    module = SimpleNamespace(num_key_value_groups=num_heads // num_kv_heads, training=False, head_dim=query.shape[2])
    block_size = key_cache.shape[1]
    outputs = []
    starts = batch["query_start_loc"].tolist()
    for seq, context_len in enumerate(batch["context_lens"].tolist()):
        seq_query = query[starts[seq]:starts[seq + 1]]
        if seq_query.shape[0] == 0:
            continue
        blocks = batch["block_tables"][seq, : -(-context_len // block_size)].long()
        keys = key_cache[blocks].flatten(0, 1)[:context_len]
        values = value_cache[blocks].flatten(0, 1)[:context_len]
        query_pos = torch.arange(context_len - seq_query.shape[0], context_len)[:, None]
        key_pos = torch.arange(context_len)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
        out, _ = eager_attention_forward(module, seq_query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], mask, scaling=batch["scale"],
                                         softcap=soft_cap)
        outputs.append(out[0])
    return torch.cat(outputs)


def sharpened(batch: dict, factor: float = 8.0) -> dict:
    """Larger queries, so scores reach the soft cap and capping visibly changes the result."""
    return {**batch, "query": batch["query"] * factor}


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_soft_capped_reference_is_hf_gemma2_attention(sliding_window):
    batch = sharpened(make_paged_batch([1, 5, 20, 0], [29, 45, 20, 3], 6, 2, 32))
    expected = hf_gemma2_attention(batch, soft_cap=5.0, sliding_window=sliding_window)

    actual = reference.paged_attention(**batch, sliding_window=sliding_window, soft_cap=5.0)

    assert_close(actual.cpu(), expected)
    uncapped = reference.paged_attention(**batch, sliding_window=sliding_window)
    assert (uncapped.cpu() - expected).abs().max() > 0.05  # the cap is not a no-op on these scores


# Every CPU shortcut: a decode batch, a lone decode, a short and a long (chunked) fresh prefill,
# a prefill chunk after a cached prefix, a mixed batch.
CPU_SHAPES = {
    "decode_batch": ([1, 1, 1], [1, 33, 200]),
    "single_decode": ([1], [37]),
    "short_fresh_prefill": ([40], [40]),
    "long_fresh_prefill": ([150], [150]),
    "prefix_then_chunk": ([20], [53]),
    "mixed": ([1, 5, 70, 1, 20], [29, 45, 70, 97, 20]),
}


@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("shape", CPU_SHAPES)
def test_soft_capped_cpu_attention_matches_reference(shape, sliding_window):
    query_lens, context_lens = CPU_SHAPES[shape]
    batch = on_cpu(sharpened(make_paged_batch(query_lens, context_lens, 6, 2, 32)))
    expected = reference.paged_attention(**batch, sliding_window=sliding_window, soft_cap=5.0)
    assert_close(cpu_ops.paged_attention(**batch, sliding_window=sliding_window, soft_cap=5.0), expected)
    assert_close(kernels.paged_attention(**batch, sliding_window=sliding_window, soft_cap=5.0), expected)


@pytest.mark.parametrize("query_lens, context_lens, sliding_window", [
    ([1, 5, 70, 1, 20], [29, 45, 70, 97, 20], None),     # the prefill kernel
    ([1, 5, 70, 1, 20], [29, 45, 70, 97, 20], 24),
    ([1, 1, 1], [1300, 17, 40], None),                   # the split decode kernel and its reduce
    ([1, 1], [1300, 40], 700),
])
def test_soft_capped_triton_attention_matches_reference(query_lens, context_lens, sliding_window):
    batch = sharpened(make_paged_batch(query_lens, context_lens, 6, 2, 32))
    expected = reference.paged_attention(**batch, sliding_window=sliding_window, soft_cap=5.0)
    assert_close(triton_ops.paged_attention(**batch, sliding_window=sliding_window, soft_cap=5.0), expected)


def test_soft_capped_triton_attention_in_bf16():
    batch = sharpened(make_paged_batch([1, 9, 1], [300, 9, 20], 4, 2, 32, dtype=torch.bfloat16), 4.0)
    expected = reference.paged_attention(**batch, soft_cap=10.0)
    assert_close(triton_ops.paged_attention(**batch, soft_cap=10.0), expected, torch.bfloat16)


@pytest.mark.parametrize("implementation", [reference, cpu_ops, triton_ops])
@pytest.mark.parametrize("soft_cap", [0.0, -1.0])
def test_paged_attention_rejects_a_soft_cap_that_is_not_positive(implementation, soft_cap):
    batch = make_paged_batch([1], [4], 2, 2, 16)
    with pytest.raises(ValueError, match="soft_cap"):
        implementation.paged_attention(**batch, soft_cap=soft_cap)


# --------------------------------------------------------------------------------------------
# rotary_embedding: partial rotary and GPT-J (interleaved) pairs
# --------------------------------------------------------------------------------------------


def rotary_case(rotary_dim, head_dim=32, dtype=torch.float32, seed=0):
    """Strided query and key views of a merged projection, positions, and a real rotary table (in the
    model's dtype, as the engine keeps it)."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens, num_heads, num_kv_heads = 6, 4, 2
    merged = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, generator=generator)
    query = merged[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    key = merged[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 50, 99, 7], device=DEVICE)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(100).float(), inv_freq)
    cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=DEVICE, dtype=dtype)
    return query, key, positions, cos_sin_cache


def test_partial_neox_rotary_reference_is_hf_phi3():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    query, key, positions, cache = rotary_case(rotary_dim=24)
    cos, sin = cache[positions].chunk(2, dim=-1)
    # HF's [batch, heads, tokens, dims] layout, its tables duplicated to the rotary width.
    expected = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                    torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None])

    actual = reference.rotary_embedding(query, key, positions, cache)

    for got, want in zip(actual, expected):
        assert_close(got, want[0].transpose(0, 1))
    assert torch.equal(actual[0][..., 24:], query[..., 24:])  # the unrotated dims pass through


def test_interleaved_rotary_reference_is_hf_cohere():
    from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb

    query, key, positions, cache = rotary_case(rotary_dim=32)
    cos, sin = cache[positions].chunk(2, dim=-1)
    expected = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                    cos.repeat_interleave(2, -1)[None], sin.repeat_interleave(2, -1)[None])

    actual = reference.rotary_embedding(query, key, positions, cache, is_neox_style=False)

    for got, want in zip(actual, expected):
        assert_close(got, want[0].transpose(0, 1))
    neox = reference.rotary_embedding(query, key, positions, cache)
    assert not torch.allclose(neox[0], actual[0])  # the style matters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 24, 8])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_rotary_embedding_matches_reference(implementation, rotary_dim, is_neox_style, dtype):
    query, key, positions, cache = rotary_case(rotary_dim, dtype=dtype)
    if implementation == "cpu":
        query, key, positions, cache = query.cpu(), key.cpu(), positions.cpu(), cache.cpu()
    actual = IMPLEMENTATIONS[implementation].rotary_embedding(query, key, positions, cache, is_neox_style)
    expected = reference.rotary_embedding(query, key, positions, cache, is_neox_style)
    for got, want in zip(actual, expected):
        assert_close(got, want)


@pytest.mark.parametrize("implementation", [reference, cpu_ops, triton_ops])
@pytest.mark.parametrize("rotary_dim", [40, 23])
def test_rotary_embedding_rejects_a_table_wider_than_the_head_or_odd(implementation, rotary_dim):
    query, key, positions, _ = rotary_case(32)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        implementation.rotary_embedding(query, key, positions, torch.randn(100, rotary_dim, device=DEVICE), False)


# --------------------------------------------------------------------------------------------
# qk_norm_rope_and_cache with partial or GPT-J rotary
# --------------------------------------------------------------------------------------------


def attention_inputs(rotary_dim, has_norm, dtype=torch.float32, num_tokens=5, num_heads=4, num_kv_heads=2,
                     head_dim=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, generator=generator)
    positions = torch.randint(0, 90, (num_tokens,), generator=generator).to(DEVICE)
    cache = rotary_case(rotary_dim, head_dim)[3]
    num_blocks = num_tokens // 16 + 4
    slots = torch.randperm(num_blocks * 16, generator=generator)[:num_tokens].to(DEVICE)
    norms = [randn(head_dim, dtype=dtype, generator=generator) for _ in range(2)] if has_norm else [None, None]
    caches = [torch.zeros(num_blocks, 16, num_kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(2)]
    return qkv, positions, cache, caches, slots, norms, (num_heads, num_kv_heads, head_dim)


def single_ops(qkv, positions, cache, caches, slots, norms, sizes, is_neox_style):
    """The layer's attention inputs from reference ops alone, written out."""
    num_heads, num_kv_heads, head_dim = sizes
    query, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    query, key = query.unflatten(-1, (num_heads, head_dim)), key.unflatten(-1, (num_kv_heads, head_dim))
    if norms[0] is not None:
        query, key = reference.rms_norm(query, norms[0], 1e-6)[0], reference.rms_norm(key, norms[1], 1e-6)[0]
    query, key = reference.rotary_embedding(query, key, positions, cache, is_neox_style)
    reference.write_kv_cache(key, value.unflatten(-1, (num_kv_heads, head_dim)), *caches, slots)
    return query


@pytest.mark.parametrize("rotary_dim, is_neox_style", [(24, True), (32, False), (16, False)])
@pytest.mark.parametrize("has_norm", [False, True])
def test_qk_norm_rope_and_cache_with_partial_or_interleaved_rotary(rotary_dim, is_neox_style, has_norm):
    qkv, positions, cache, caches, slots, norms, sizes = attention_inputs(rotary_dim, has_norm)
    expected_caches = [c.clone() for c in caches]
    expected_query = single_ops(qkv, positions, cache, expected_caches, slots, norms, sizes, is_neox_style)

    query = kernels.qk_norm_rope_and_cache(qkv, positions, cache, *caches, slots, sizes[0], sizes[1], *norms, 1e-6,
                                           is_neox_style=is_neox_style)

    assert_close(query, expected_query)
    for got, want in zip(caches, expected_caches):
        assert_close(got, want)


def test_fused_triton_kernel_refuses_rotary_it_does_not_fuse():
    qkv, positions, cache, caches, slots, norms, sizes = attention_inputs(24, has_norm=False)
    with pytest.raises(ValueError, match="NeoX"):
        triton_ops.qk_norm_rope_and_cache(qkv, positions, cache, *caches, slots, sizes[0], sizes[1])
    assert not triton_ops.supports_fused_rotary(32, 32, is_neox_style=False)
    assert triton_ops.supports_fused_rotary(32, 32, is_neox_style=True)


# --------------------------------------------------------------------------------------------
# gelu_and_mul, gelu
# --------------------------------------------------------------------------------------------

HF_GELU = {"tanh": "gelu_pytorch_tanh", "none": "gelu"}


@pytest.mark.parametrize("approximate", HF_GELU)
def test_gelu_references_are_hf_activations(approximate):
    from transformers.activations import ACT2FN

    x = randn(3, 2 * 40)
    gate, up = x.chunk(2, dim=-1)
    assert_close(reference.gelu_and_mul(x, approximate), ACT2FN[HF_GELU[approximate]](gate) * up)
    assert_close(reference.gelu(x, approximate), ACT2FN[HF_GELU[approximate]](x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", HF_GELU)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gelu_and_mul_and_gelu_match_reference(implementation, approximate, dtype):
    x = randn(2, 3, 2 * 1500, dtype=dtype)  # more than one column block per row
    if implementation == "cpu":
        x = x.cpu()
    ops = IMPLEMENTATIONS[implementation]
    assert_close(ops.gelu_and_mul(x, approximate), reference.gelu_and_mul(x, approximate))
    assert_close(ops.gelu(x, approximate), reference.gelu(x, approximate))


def test_the_dispatch_reaches_gelu_with_its_default_tanh_approximation():
    x = torch.randn(4, 64)
    assert_close(kernels.gelu_and_mul(x), reference.gelu_and_mul(x, "tanh"))
    assert_close(kernels.gelu(x), reference.gelu(x, "tanh"))
    assert not torch.allclose(kernels.gelu(x), reference.gelu(x, "none"), atol=1e-6, rtol=0)


@pytest.mark.parametrize("implementation", [reference, cpu_ops, triton_ops])
def test_gelu_rejects_an_unknown_approximation(implementation):
    with pytest.raises(ValueError, match="approximate"):
        implementation.gelu_and_mul(randn(2, 8), "sigmoid")
    with pytest.raises(ValueError, match="approximate"):
        implementation.gelu(randn(2, 8), "erf")


# --------------------------------------------------------------------------------------------
# layer_norm
# --------------------------------------------------------------------------------------------


def test_layer_norm_references_are_hf_layer_norms():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    x = randn(5, 48)
    cohere = CohereLayerNorm(48, eps=1e-5).to(DEVICE)
    torch.nn.init.normal_(cohere.weight)
    torch.nn.init.normal_(cohere.bias) if getattr(cohere, "bias", None) is not None else None
    torch_norm = torch.nn.LayerNorm(48, eps=1e-5).to(DEVICE)
    torch.nn.init.normal_(torch_norm.weight)
    torch.nn.init.normal_(torch_norm.bias)
    with torch.no_grad():
        assert_close(reference.layer_norm(x, cohere.weight, None, 1e-5)[0], cohere(x))
        assert_close(reference.layer_norm(x, torch_norm.weight, torch_norm.bias, 1e-5)[0], torch_norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("has_residual", [True, False])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_layer_norm_matches_reference(implementation, has_residual, has_bias, dtype):
    x, residual = randn(2, 3, 96, dtype=dtype), randn(2, 3, 96, dtype=dtype)
    weight, bias = randn(96, dtype=dtype), randn(96, dtype=dtype)
    if implementation == "cpu":
        x, residual, weight, bias = x.cpu(), residual.cpu(), weight.cpu(), bias.cpu()
    residual, bias = residual if has_residual else None, bias if has_bias else None

    normed, summed = IMPLEMENTATIONS[implementation].layer_norm(x, weight, bias, 1e-5, residual)
    expected_normed, expected_summed = reference.layer_norm(x, weight, bias, 1e-5, residual)

    assert_close(normed, expected_normed)
    assert_close(summed, expected_summed)  # not equal: the interpreter truncates where a GPU rounds
    if not has_residual:
        assert summed is x


def test_layer_norm_through_the_dispatch_returns_the_sum_for_the_next_residual():
    x, residual, weight = torch.randn(4, 32), torch.randn(4, 32), torch.rand(32)
    normed, summed = kernels.layer_norm(x, weight, None, 1e-6, residual)
    assert torch.equal(summed, x + residual)
    assert_close(normed, reference.layer_norm(x + residual, weight, None, 1e-6)[0])


# --------------------------------------------------------------------------------------------
# Full-size shapes, on a GPU only (Gemma 2 / Phi-4-mini / Cohere / StarCoder2 sizes).
# --------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("sliding_window", [None, 4096])
def test_soft_capped_attention_full_size_mixed_batch(sliding_window):
    # Gemma 2 9B: 16 query heads over 8 KV heads of 256, soft cap 50.
    query_lens = [1, 1, 300, 1, 2048, 77, 1]
    context_lens = [4096, 1, 300, 5000, 2048, 3000, 1025]
    batch = make_paged_batch(query_lens, context_lens, 16, 8, 256, dtype=torch.bfloat16)
    expected = reference.paged_attention(**batch, sliding_window=sliding_window, soft_cap=50.0)
    assert_close(triton_ops.paged_attention(**batch, sliding_window=sliding_window, soft_cap=50.0), expected,
                 torch.bfloat16)


@needs_cuda
def test_soft_capped_attention_full_size_decode_batch():
    context_lens = [4096, 1, 2500, 511, 513, 17, 3000, 1025] * 4
    batch = sharpened(make_paged_batch([1] * len(context_lens), context_lens, 16, 8, 256, dtype=torch.bfloat16), 4.0)
    expected = reference.paged_attention(**batch, soft_cap=50.0)
    assert_close(triton_ops.paged_attention(**batch, soft_cap=50.0), expected, torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("rotary_dim, is_neox_style", [(96, True), (128, False), (64, False)])
def test_rotary_embedding_full_size(rotary_dim, is_neox_style):
    # Phi-4-mini: 24 heads of 128 with 96 rotating; Cohere: interleaved pairs over the whole head.
    query, key = randn(512, 24, 128, dtype=torch.bfloat16), randn(512, 8, 128, dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (512,), device=DEVICE)
    cache = randn(4096, rotary_dim)
    for got, want in zip(triton_ops.rotary_embedding(query, key, positions, cache, is_neox_style),
                         reference.rotary_embedding(query, key, positions, cache, is_neox_style)):
        assert_close(got, want)


@needs_cuda
@pytest.mark.parametrize("rotary_dim, is_neox_style", [(96, True), (128, False)])
def test_qk_norm_rope_and_cache_full_size_unfused_rotary(rotary_dim, is_neox_style):
    inputs = attention_inputs(128, has_norm=True, dtype=torch.bfloat16, num_tokens=100, num_heads=24,
                              num_kv_heads=8, head_dim=128)
    qkv, positions, _, caches, slots, norms, sizes = inputs
    cache = randn(4096, rotary_dim)
    positions = torch.randint(0, 4096, (100,), device=DEVICE)
    expected_caches = [c.clone() for c in caches]
    expected_query = single_ops(qkv, positions, cache, expected_caches, slots, norms, sizes, is_neox_style)
    query = kernels.qk_norm_rope_and_cache(qkv, positions, cache, *caches, slots, sizes[0], sizes[1], *norms, 1e-6,
                                           is_neox_style=is_neox_style)
    assert_close(query, expected_query)
    for got, want in zip(caches, expected_caches):
        assert_close(got, want)


@needs_cuda
@pytest.mark.parametrize("approximate", HF_GELU)
def test_activations_and_layer_norm_full_size(approximate):
    gate_up = randn(512, 2 * 14336, dtype=torch.bfloat16)
    assert_close(triton_ops.gelu_and_mul(gate_up, approximate), reference.gelu_and_mul(gate_up, approximate))
    up = randn(512, 12288, dtype=torch.bfloat16)
    assert_close(triton_ops.gelu(up, approximate), reference.gelu(up, approximate))
    x, residual = randn(512, 4096, dtype=torch.bfloat16), randn(512, 4096, dtype=torch.bfloat16)
    weight, bias = randn(4096, dtype=torch.bfloat16), randn(4096, dtype=torch.bfloat16)
    for has_bias in (True, False):
        for got, want in zip(triton_ops.layer_norm(x, weight, bias if has_bias else None, 1e-5, residual),
                             reference.layer_norm(x, weight, bias if has_bias else None, 1e-5, residual)):
            assert_close(got, want)


# --------------------------------------------------------------------------------------------
# sample_rows: the engine's sampling math, told on the host which filters apply
# --------------------------------------------------------------------------------------------


def sorted_filter_probs(logits, temperatures, top_ks, top_ps, min_ps):
    """Top-k/top-p/min-p probabilities in vocabulary order by sorting the whole vocabulary: an
    independent formulation (the engine's before sampling moved into the kernels)."""
    logits = logits / temperatures[:, None]
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.where(top_ks > 0, top_ks, vocab)
    remove = torch.arange(vocab, device=logits.device)[None, :] >= ks[:, None]
    sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    remove |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_ps[:, None]
    remove[:, 0] = False
    probs = torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(remove, float("-inf"))).softmax(-1)
    return probs.masked_fill(probs < min_ps[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_cpu_argmax_takes_each_rows_first_maximum_with_nan_largest(rows, dtype):
    x = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x[0, 7] = x[0, 40000] = 100.0  # a tie: the first one
    if rows > 1:
        x[1, 30000] = x[1, 20] = float("nan")  # NaN beats every number: the first NaN
        x[1, 10] = float("inf")
    got = cpu_sampling.argmax(x)
    assert got.dtype == torch.int64 and got.tolist() == reference_sampling.argmax(x).tolist()
    assert got[0] == 7 and (rows == 1 or got[1] == 20)


@pytest.mark.parametrize("implementation", ["reference", "cpu", "triton"])
def test_sample_rows_with_caller_noise_races_the_filtered_probabilities(implementation):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 300, generator=generator) * 3).to(DEVICE)
    temperatures = torch.tensor([0.7, 1.0, 1.3, 0.9, 1.0, 0.5], device=DEVICE)
    top_ks = torch.tensor([5, 0, 40, 300, 1, 12], device=DEVICE)
    top_ps = torch.tensor([1.0, 0.8, 0.95, 0.5, 1.0, 0.9], device=DEVICE)
    min_ps = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.3], device=DEVICE)
    noise = torch.empty(6, 300).exponential_(generator=generator).to(DEVICE)
    expected = (sorted_filter_probs(logits, temperatures, top_ks, top_ps, min_ps) / noise).argmax(dim=-1)
    sample_rows = {"reference": reference_sampling.sample_rows, "cpu": cpu_sampling.sample_rows,
                   "triton": triton_ops_sampling.sample_rows}[implementation]

    tokens = sample_rows(logits, temperatures, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps, num_candidates=300,
                         noise=noise)

    assert tokens.tolist() == expected.tolist()
    # Narrower candidates give the same draws when they cover every row's k (top-p rows need all).
    narrow = sample_rows(logits[[0, 2, 5]], temperatures[[0, 2, 5]], top_ks=top_ks[[0, 2, 5]],
                         top_ps=top_ps[[0, 2, 5]], min_ps=min_ps[[0, 2, 5]], num_candidates=40, noise=noise[[0, 2, 5]])
    assert narrow.tolist() == expected[[0, 2, 5]].tolist()


@pytest.mark.parametrize("implementation", ["cpu", "triton"])
def test_sample_rows_plain_temperature_follows_the_softmax(implementation):
    logits = LOGITS_ROW.to(DEVICE).expand(4000, -1).contiguous()
    temperatures = torch.full((4000,), 1.5, device=DEVICE)
    generator = torch.Generator(DEVICE).manual_seed(0)
    sample_rows = cpu_sampling.sample_rows if implementation == "cpu" else triton_ops_sampling.sample_rows
    if implementation == "cpu":
        logits, temperatures, generator = logits.cpu(), temperatures.cpu(), torch.Generator().manual_seed(0)

    tokens = sample_rows(logits, temperatures, generator=generator)

    frequencies = torch.bincount(tokens.cpu(), minlength=6).float() / 4000
    torch.testing.assert_close(frequencies, torch.softmax(LOGITS_ROW / 1.5, -1), atol=0.03, rtol=0)


@needs_cuda
@pytest.mark.parametrize("options", [dict(), dict(num_candidates=50), dict(num_candidates=151_936),
                                     dict(num_candidates=50, noise=True)])
def test_sample_rows_never_waits_for_the_device(options):
    logits = randn(64, 151_936)
    options = dict(options, top_ks=torch.full((64,), 50, device=DEVICE), top_ps=torch.full((64,), 0.9, device=DEVICE))
    if options.pop("noise", False):
        options["noise"] = torch.empty_like(logits).exponential_()
    else:
        options["generator"] = torch.Generator(DEVICE).manual_seed(0)
    temperatures = torch.full((64,), 0.8, device=DEVICE)
    kernels.sample_rows(logits, temperatures, **options)  # compiles the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = kernels.sample_rows(logits, temperatures, **options)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (64,)
