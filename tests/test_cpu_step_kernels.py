"""The C kernels of the CPU decode step (``kernels/cpu_step_native.py``) against the torch references,
and the model's CPU step through them (``engine/models/cpu_step.py``) against its layers' own forward.

Skipped where the kernels cannot be built (no C compiler)."""
from __future__ import annotations

import pytest
import torch

from hearth_llm.kernels import cpu_step_native as native
from hearth_llm.kernels.activation import reference as activation_reference
from hearth_llm.kernels.attention import reference as attention_reference
from hearth_llm.kernels.attention_inputs import reference as inputs_reference
from hearth_llm.kernels.norm import reference as norm_reference

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the CPU step kernels")

# float32: the kernels sum in another order; bf16: one rounding step apart at most.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = (torch.float32, torch.bfloat16)


def assert_close(actual, expected):
    atol, rtol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def randn(*shape, dtype, generator):
    return torch.randn(*shape, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_matches_reference(dtype, has_residual):
    generator = torch.Generator().manual_seed(0)
    x, weight = randn(5, 96, dtype=dtype, generator=generator), randn(96, dtype=dtype, generator=generator)
    residual = randn(5, 96, dtype=dtype, generator=generator) if has_residual else None
    normed, summed = native.rms_norm(x, weight, 1e-5, residual)
    expected_normed, expected_sum = norm_reference.rms_norm(x, weight, 1e-5, residual)
    assert_close(normed, expected_normed)
    assert torch.equal(summed, expected_sum)


def test_rms_norm_updates_the_residual_in_place_when_asked():
    generator = torch.Generator().manual_seed(1)
    x, weight = randn(3, 64, dtype=torch.bfloat16, generator=generator), randn(64, dtype=torch.bfloat16, generator=generator)
    residual = randn(3, 64, dtype=torch.bfloat16, generator=generator)
    expected_normed, expected_sum = norm_reference.rms_norm(x, weight, 1e-6, residual)
    normed, summed = native.rms_norm(x, weight, 1e-6, residual, sum_out=residual)
    assert summed is residual and torch.equal(residual, expected_sum)
    assert_close(normed, expected_normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    x = randn(4, 2 * 200, dtype=dtype, generator=torch.Generator().manual_seed(2)) * 4
    assert_close(native.silu_and_mul(x), activation_reference.silu_and_mul(x))


def _paged_step(query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype, rotary_dim=None, block_size=16,
                seed=0):
    """A step's qkv rows and int64 metadata over a paged cache whose blocks are shuffled."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-context // block_size) for context in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(query_lens), max(blocks_per_seq) + 1, dtype=torch.int64)
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = torch.tensor([order.pop() for _ in range(count)])
    positions = torch.cat([torch.arange(context - q, context) for q, context in zip(query_lens, context_lens)])
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    rotary_dim = rotary_dim or head_dim
    freqs = torch.outer(torch.arange(1024.0), 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2) / rotary_dim))
    return dict(
        qkv=randn(sum(query_lens), (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, generator=generator),
        positions=positions, cos_sin_cache=torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype),
        key_cache=randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=generator),
        value_cache=randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=generator),
        slot_mapping=slots, num_heads=num_heads, num_kv_heads=num_kv_heads,
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0), context_lens=torch.tensor(context_lens),
        block_tables=tables, scale=head_dim**-0.5,
    )


def _reference(step, sliding_window=None):
    """The references' rotary + cache write + paged attention, on copies of the caches."""
    key_cache, value_cache = step["key_cache"].clone(), step["value_cache"].clone()
    query = inputs_reference.qk_norm_rope_and_cache(
        step["qkv"], step["positions"], step["cos_sin_cache"], key_cache, value_cache, step["slot_mapping"],
        step["num_heads"], step["num_kv_heads"])
    query_lens = step["query_start_loc"].diff()
    out = attention_reference.paged_attention(
        query, key_cache, value_cache, step["block_tables"], step["context_lens"], step["query_start_loc"],
        int(query_lens.max()), int(step["context_lens"].max()), step["scale"], sliding_window)
    return out.reshape(out.shape[0], -1), key_cache, value_cache


CASES = {
    "one decode row": ([1], [37], 9, 3, 64, None),
    "a verification of five rows": ([5], [200], 9, 3, 64, None),
    "two sequences, a decode and a verification": ([1, 4], [20, 70], 4, 2, 32, None),
    "a sliding window inside the context": ([3], [90], 4, 4, 32, 17),
    "partial rotary": ([2], [33], 2, 1, 32, None),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_rope_cache_attention_matches_the_references(dtype, case):
    query_lens, context_lens, num_heads, num_kv_heads, head_dim, window = CASES[case]
    step = _paged_step(query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype,
                       rotary_dim=head_dim // 2 if case == "partial rotary" else None)
    expected, expected_keys, expected_values = _reference(step, window)
    out = native.rope_cache_attention(**step, sliding_window=window)
    assert_close(out, expected)
    assert_close(step["key_cache"], expected_keys)  # rotated keys stored (bf16: rounded once less)
    assert torch.equal(step["value_cache"], expected_values)


def test_rope_cache_attention_spread_over_threads_matches_the_references():
    # enough positions x heads for the kernel to split its (sequence, kv head) pairs over threads
    step = _paged_step([1, 2, 1], [700, 900, 650], 8, 2, 64, torch.float32)
    expected, expected_keys, _ = _reference(step)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = native.rope_cache_attention(**step)
    finally:
        torch.set_num_threads(threads)
    assert_close(out, expected)
    assert_close(step["key_cache"], expected_keys)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_verification_rows_bits_are_those_of_one_row_decode_steps(dtype):
    # Speculative decoding: a k+1-row verification must score each row as decode steps one at a time would.
    step = _paged_step([5], [60], 9, 3, 64, dtype)
    key_cache, value_cache = step["key_cache"].clone(), step["value_cache"].clone()
    together = native.rope_cache_attention(**step)
    rows = []
    for row in range(5):
        position = 55 + row
        one = dict(step, qkv=step["qkv"][row:row + 1], positions=step["positions"][row:row + 1],
                   slot_mapping=step["slot_mapping"][row:row + 1], key_cache=key_cache, value_cache=value_cache,
                   query_start_loc=torch.tensor([0, 1]), context_lens=torch.tensor([position + 1]))
        rows.append(native.rope_cache_attention(**one))
    assert torch.equal(together, torch.cat(rows))
    assert torch.equal(step["key_cache"], key_cache) and torch.equal(step["value_cache"], value_cache)


def test_attention_step_binds_the_metadata_once_for_every_layer():
    step = _paged_step([5], [50], 4, 2, 32, torch.float32)
    expected, _, _ = _reference(step)
    bound = native.AttentionStep.of(step["positions"], step["slot_mapping"], step["query_start_loc"],
                                    step["context_lens"], step["block_tables"])
    out = bound.attend(step["qkv"], step["cos_sin_cache"], step["key_cache"], step["value_cache"], 4, 2, step["scale"])
    assert_close(out, expected)


def test_attention_step_is_none_for_int32_metadata():
    step = _paged_step([1], [10], 2, 1, 32, torch.float32)
    assert native.AttentionStep.of(step["positions"].int(), step["slot_mapping"], step["query_start_loc"],
                                   step["context_lens"], step["block_tables"]) is None


def test_attention_step_is_none_for_a_slot_outside_the_cache():
    step = _paged_step([1], [10], 2, 1, 32, torch.float32)
    outside = torch.tensor([step["key_cache"].shape[0] * step["key_cache"].shape[1]])
    assert native.AttentionStep.of(step["positions"], outside, step["query_start_loc"], step["context_lens"],
                                   step["block_tables"], step["key_cache"].shape, 1024) is None
    assert native.AttentionStep.of(step["positions"], step["slot_mapping"], step["query_start_loc"],
                                   step["context_lens"], step["block_tables"], step["key_cache"].shape, 1024) is not None


def test_attention_step_refuses_qkv_rows_of_another_width():
    step = _paged_step([1], [10], 2, 1, 32, torch.float32)
    bound = native.AttentionStep.of(step["positions"], step["slot_mapping"], step["query_start_loc"],
                                    step["context_lens"], step["block_tables"])
    with pytest.raises(ValueError, match="qkv"):
        bound.attend(step["qkv"][:, :-32], step["cos_sin_cache"], step["key_cache"], step["value_cache"], 2, 1, 0.1)


# --------------------------------------------------------------------------------------------
# The model's CPU step through the kernels, against its layers' own forward
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: per-head q/k norms before rotary
@pytest.mark.parametrize("num_rows", [1, 5])
def test_cpu_step_of_a_tiny_llama_matches_its_layers_forward(tiny_model_dirs, num_rows, family, monkeypatch):
    from hearth_llm.engine.loader import load_checkpoint
    from hearth_llm.engine.loader.model_loader import load_model
    from hearth_llm.engine.models import cpu_step
    from hearth_llm.engine.models.attention import AttentionMetadata

    model, arch = load_model(load_checkpoint(str(tiny_model_dirs[family]), torch.float32), torch.device("cpu"),
                             torch.float32)
    block_size, context = 16, 40
    caches = [(torch.zeros(8, block_size, arch.num_key_value_heads, arch.head_dim),
               torch.zeros(8, block_size, arch.num_key_value_heads, arch.head_dim))
              for _ in range(arch.num_hidden_layers)]
    table = torch.tensor([[5, 2, 7, 0]])

    def meta_for(start, count):
        positions = torch.arange(start, start + count)
        return positions, AttentionMetadata(
            slot_mapping=table[0, positions // block_size] * block_size + positions % block_size, block_tables=table,
            context_lens=torch.tensor([start + count]), query_start_loc=torch.tensor([0, count]),
            max_query_len=count, max_context_len=start + count)

    ids = torch.randint(0, arch.vocab_size, (context,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model(ids[:context - num_rows], *meta_for(0, context - num_rows)[:1], caches,
              meta_for(0, context - num_rows)[1])  # the prefix, by the layers' own forward (a long prefill)
        saved = [(k.clone(), v.clone()) for k, v in caches]
        positions, meta = meta_for(context - num_rows, num_rows)
        fast = cpu_step.run_layers(model, model.embed(ids[-num_rows:]), positions, caches, meta)
        assert fast is not None
        fast_out = model.norm(*fast)[0]
        for (k, v), (k0, v0) in zip(caches, saved):
            k.copy_(k0), v.copy_(v0)
        monkeypatch.setattr(cpu_step, "ENABLED", False)
        plain_out = model(ids[-num_rows:], positions, caches, meta)
    torch.testing.assert_close(fast_out, plain_out, atol=1e-4, rtol=1e-4)
