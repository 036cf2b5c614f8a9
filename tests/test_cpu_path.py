"""The CPU fast path: ``cpu_ops`` agrees with ``reference``, and the CPU weight formats compute the
same products as the weights they replace."""
from __future__ import annotations

import os

import pytest
import torch

from hearth_llm.kernels import cpu_ops, reference

TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


# Where oneDNN has no bf16 matmuls, pack_dense_weight makes no packed copy, so bf16 models keep plain
# linears (cpu_features: dtype="auto" runs float32 on such CPUs anyway).
NO_ONEDNN_BF16 = "this CPU has no AVX-512 BF16 or AMX: oneDNN has no bf16 matmuls"


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim=64, *, block_size=16,
                dtype=torch.float32, seed=0):
    """Sequences whose cached keys sit in shuffled, non-contiguous blocks of one cache."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(query_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor([order.pop() for _ in range(count)])
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(dtype)  # noqa: E731
    return dict(
        query=randn(sum(query_lens), num_heads, head_dim),
        key_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        value_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        block_tables=block_tables,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        scale=head_dim**-0.5,
    )


def check_attention(batch, sliding_window=None):
    expected = reference.paged_attention(**batch, sliding_window=sliding_window)
    assert_close(cpu_ops.paged_attention(**batch, sliding_window=sliding_window), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_queries_per_kv", [1, 3])
def test_decode_batch_matches_reference(dtype, num_queries_per_kv):
    check_attention(paged_batch([1, 1, 1, 1], [1, 16, 33, 200], 2 * num_queries_per_kv, 2, dtype=dtype))


def test_single_decode_with_a_partly_filled_block_matches_reference():
    check_attention(paged_batch([1], [37], 9, 3))


@pytest.mark.parametrize("context_len", [16, 37])
def test_fresh_single_prefill_matches_reference(context_len):
    check_attention(paged_batch([context_len], [context_len], 9, 3, dtype=torch.bfloat16))


def test_prefill_chunk_after_a_cached_prefix_matches_reference():
    check_attention(paged_batch([20], [53], 6, 2))


def test_mixed_batch_matches_reference():
    check_attention(paged_batch([1, 5, 70, 1, 20], [29, 45, 70, 97, 20], 6, 2))


@pytest.mark.parametrize("query_lens, context_lens", [([1, 1], [300, 40]), ([1], [300]), ([30], [30]),
                                                      ([1, 5, 20], [29, 45, 60])])
def test_sliding_window_matches_reference(query_lens, context_lens):
    check_attention(paged_batch(query_lens, context_lens, 4, 2), sliding_window=24)


def test_a_new_step_with_the_same_shapes_does_not_reuse_the_last_steps_mask():
    batch = paged_batch([1, 1], [40, 20], 4, 2)
    check_attention(batch)
    batch["context_lens"][1] = 33  # in place, as a runner reusing its step buffers would
    check_attention(batch)
    check_attention({**batch, "context_lens": torch.tensor([40, 17], dtype=torch.int32)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_matches_reference(dtype):
    x, residual, weight = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype), torch.rand(64).to(dtype)
    normed, summed = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    expected_normed, expected_summed = reference.rms_norm(x, weight, 1e-5, residual)
    assert_close(normed, expected_normed)
    assert torch.equal(summed, expected_summed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_of_strided_query_and_key_matches_reference(dtype):
    qkv = torch.randn(7, (6 + 2 + 2) * 32).to(dtype)
    query, key = qkv[:, :192].view(7, 6, 32), qkv[:, 192:256].view(7, 2, 32)
    positions = torch.tensor([0, 3, 4, 5, 9, 100, 2])
    cache = torch.randn(128, 32).to(dtype)
    for actual, expected in zip(cpu_ops.rotary_embedding(query, key, positions, cache),
                                reference.rotary_embedding(query, key, positions, cache)):
        assert_close(actual, expected)


def test_silu_and_mul_matches_reference():
    x = torch.randn(3, 64)
    assert_close(cpu_ops.silu_and_mul(x), reference.silu_and_mul(x))


def test_metadata_made_in_inference_mode_and_changed_in_place_is_not_reused():
    with torch.inference_mode():
        batch = paged_batch([1, 1], [40, 20], 4, 2)
        check_attention(batch)
        batch["context_lens"][1] = 33
        check_attention(batch)


@pytest.mark.parametrize("width", [49152, 32000, 1000, 777])
def test_argmax_finds_each_rows_first_maximum(width):
    x = torch.randn(6, width)
    x[1, 5] = x[1, width - 3] = 100.0       # a tie: the first one wins
    x[2, :] = 0.0                           # all equal
    x[3, width // 2] = float("nan")         # NaN counts as the largest, as in torch.argmax
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))
    assert torch.equal(cpu_ops.argmax(x[:2]), x[:2].argmax(dim=-1))


@pytest.mark.parametrize("width", [49152, 32000, 1000])
def test_topk_indices_are_the_rows_k_largest(width):
    x = torch.randn(5, width)
    x[0, :9] = 50.0 + torch.arange(9.0)     # the top values crowded into one chunk
    actual = cpu_ops.topk_indices(x, 8)
    assert torch.equal(x.gather(1, actual).sort(dim=-1).values, x.topk(8, dim=-1).values.sort(dim=-1).values)


# --------------------------------------------------------------------------------------------
# Weight formats and the repacked model
# --------------------------------------------------------------------------------------------


def weight_on_int4_grid(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """What a Q4_1 GGUF weight dequantizes to: per group of 32, 16 even steps from a minimum."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, columns // 32, 32), generator=generator).float()
    codes[..., 0], codes[..., 1] = 0, 15  # llama.cpp's Q4_1 puts each group's minimum and maximum on the grid
    scales = torch.rand(rows, columns // 32, 1, generator=generator) * 0.01 + 1e-3
    minimums = -(torch.rand(rows, columns // 32, 1, generator=generator) + 0.5) * 7.5 * scales
    return (codes * scales + minimums).view(rows, columns)


def test_int4_copy_is_made_for_a_weight_on_a_4bit_grid_and_computes_its_product():
    weight = weight_on_int4_grid(64, 128).bfloat16()
    int4 = cpu_ops.int4_weight_if_lossless(weight)
    assert int4 is not None
    x = torch.randn(3, 128).bfloat16()
    assert_close(cpu_ops.int4_linear(x, *int4), torch.nn.functional.linear(x, weight))


def test_no_int4_copy_for_a_weight_that_4_bits_would_round():
    assert cpu_ops.int4_weight_if_lossless(torch.randn(64, 128).bfloat16()) is None
    off_grid = weight_on_int4_grid(64, 128)
    off_grid[40, 7] += 0.002  # one weight between two steps of its group
    assert cpu_ops.int4_weight_if_lossless(off_grid.bfloat16()) is None


def test_no_int4_copy_for_float32_weights():
    assert cpu_ops.int4_weight_if_lossless(weight_on_int4_grid(64, 128)) is None


def test_dense_packed_weight_computes_the_linear_product():
    weight, x = torch.randn(48, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    packed = cpu_ops.pack_dense_weight(weight)
    if not cpu_ops.has_onednn_bf16():
        assert packed is None  # callers then keep the plain weight (F.linear)
        pytest.skip(NO_ONEDNN_BF16)
    assert packed is not None
    assert_close(cpu_ops.dense_linear(x, packed), torch.nn.functional.linear(x, weight))


def tiny_llama(dtype: torch.dtype, weights_on_grid: bool):
    from transformers import LlamaConfig

    from hearth_llm.engine.models.llama import LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         architectures=["LlamaForCausalLM"])
    arch = LlamaForCausalLM.arch_from_hf_config(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    model = model.to_empty(device="cpu").to(dtype)
    model.materialize_buffers(dtype)
    state_dict = {}
    for index, (name, param) in enumerate(model.state_dict().items()):
        if param.dim() == 2 and weights_on_grid and "embed" not in name:
            value = weight_on_int4_grid(*param.shape, seed=index)
        else:
            value = torch.randn(param.shape, generator=torch.Generator().manual_seed(index)) * 0.1
        state_dict[name] = value.to(dtype)
    hf_names = {}
    for name, value in state_dict.items():  # our fused names back to Hugging Face's
        if "qkv_proj" in name:
            q, k, v = value.split([64, 32, 32])
            hf_names |= {name.replace("qkv_proj", p): t for p, t in zip(("q_proj", "k_proj", "v_proj"), (q, k, v))}
        elif "gate_up_proj" in name:
            gate, up = value.chunk(2)
            hf_names |= {name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up}
        elif name != "lm_head.weight":
            hf_names[name] = value
    model.load_weights(hf_names)
    return model


def test_a_bf16_model_gets_cpu_linears_without_a_search_for_a_4bit_grid(monkeypatch):
    """Issue 15: the 4-bit method is chosen before loading, from the checkpoint's tensor types
    (GGUF Q4_0/Q4_1: tests/test_model_layer_seam.py); a dense checkpoint's values are not searched
    for a 4-bit grid, even when they lie on one."""
    from hearth_llm.engine.models.layers import CpuLinear, CpuLogitsHead

    monkeypatch.setattr(cpu_ops, "int4_weight_if_lossless", lambda *a: pytest.fail("searched for a 4-bit grid"))
    model = tiny_llama(torch.bfloat16, weights_on_grid=True)
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    if not cpu_ops.has_onednn_bf16():  # no packed bf16 copies to make: plain linears and head (F.linear)
        assert not linears and type(model.lm_head) is torch.nn.Linear
        return
    assert len(linears) == 2 * 4
    assert all(m.int4 is None and m.packed_weight is not None for m in linears)
    assert isinstance(model.lm_head, CpuLogitsHead)


def test_a_float32_model_keeps_its_plain_linears():
    from hearth_llm.engine.models.layers import CpuLinear

    model = tiny_llama(torch.float32, weights_on_grid=True)
    assert not any(isinstance(m, CpuLinear) for m in model.modules())
    assert type(model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("num_rows", [1, 9])
def test_logits_head_gives_float32_logits_whose_top_values_are_exact(num_rows):
    if not cpu_ops.has_onednn_bf16():
        pytest.skip(NO_ONEDNN_BF16 + " (the bf16 head stays a plain nn.Linear)")
    model = tiny_llama(torch.bfloat16, weights_on_grid=False)
    hidden = torch.randn(num_rows, 64).bfloat16()
    logits = model.compute_logits(hidden)
    exact = hidden.float() @ model.embed_tokens.weight.float().t()
    assert logits.dtype == torch.float32
    top = exact.topk(4, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(dim=-1), exact.argmax(dim=-1))


# --------------------------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------------------------


def test_auto_dtype_on_a_bf16_cpu_is_bf16_for_gguf_and_16_bit_dirs_only(tmp_path, monkeypatch):
    from hearth_llm.engine import config as config_module
    from hearth_llm.engine.config import EngineConfig

    monkeypatch.setattr(config_module, "has_native_cpu_bf16", lambda: True)
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    (tmp_path / "fp32").mkdir()
    (tmp_path / "fp32" / "config.json").write_text('{"dtype": "float32"}')
    dtype_of = lambda model: EngineConfig(model=model, device="cpu").torch_dtype  # noqa: E731
    assert dtype_of("default") == torch.bfloat16
    assert dtype_of("/models/x.Q4_K_M.gguf") == torch.bfloat16
    assert dtype_of(str(tmp_path / "bf16")) == torch.bfloat16
    assert dtype_of(str(tmp_path / "fp32")) == torch.float32
    assert EngineConfig(model="default", device="cpu", dtype="float32").torch_dtype == torch.float32
    monkeypatch.setattr(config_module, "has_native_cpu_bf16", lambda: False)
    assert dtype_of("default") == torch.float32


def test_default_thread_count_never_exceeds_torchs_or_the_cores_we_may_use():
    from hearth_llm.engine.config import EngineConfig

    num_threads = EngineConfig().num_threads
    assert 1 <= num_threads <= torch.get_num_threads()
    assert num_threads <= len(os.sched_getaffinity(0))
    assert EngineConfig(num_threads=1).num_threads == 1
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0)


def test_attention_over_one_contiguous_run_of_blocks_matches_reference():
    batch = paged_batch([1], [45], 9, 3)
    batch["block_tables"][0, :3] = torch.tensor([2, 3, 4])
    check_attention(batch)
    prefill = paged_batch([45], [45], 9, 3)
    prefill["block_tables"][0, :3] = torch.tensor([1, 2, 3])
    check_attention(prefill)


@pytest.mark.parametrize("query_len, context_len, sliding_window", [(300, 300, None), (200, 260, None),
                                                                     (300, 300, 100)])
def test_long_single_prefill_in_query_chunks_matches_reference(query_len, context_len, sliding_window):
    check_attention(paged_batch([query_len], [context_len], 9, 3, dtype=torch.bfloat16), sliding_window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("query_len, context_len, sliding_window", [(128, 128, None), (201, 201, None),
                                                                     (150, 233, None), (201, 201, 50),
                                                                     (150, 233, 70)])
def test_chunked_prefill_with_query_heads_stacked_per_kv_head_matches_reference(
        dtype, num_heads, num_kv_heads, query_len, context_len, sliding_window):
    check_attention(paged_batch([query_len], [context_len], num_heads, num_kv_heads, dtype=dtype), sliding_window)


def kv_write(slot_mapping, num_blocks=40, block_size=16):
    generator = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, slot_mapping.shape[0], 3, 8, generator=generator).bfloat16().unbind(0)
    caches = [torch.zeros(num_blocks, block_size, 3, 8, dtype=torch.bfloat16) for _ in range(4)]
    cpu_ops.write_kv_cache(key, value, caches[0], caches[1], slot_mapping)
    reference.write_kv_cache(key, value, caches[2], caches[3], slot_mapping)
    return caches


@pytest.mark.parametrize("slot_mapping", [torch.arange(37, 37 + 100), torch.arange(100).flip(0),
                                          torch.cat((torch.arange(16, 80), torch.arange(320, 356)))],
                         ids=["one run", "reversed", "two runs"])
def test_kv_write_of_a_long_prefill_stores_each_token_at_its_slot(slot_mapping):
    key_cache, value_cache, expected_key_cache, expected_value_cache = kv_write(slot_mapping)
    assert torch.equal(key_cache, expected_key_cache) and torch.equal(value_cache, expected_value_cache)


def test_kv_write_with_new_slots_in_place_does_not_reuse_the_last_steps_run():
    with torch.inference_mode():
        slot_mapping = torch.arange(100)
        kv_write(slot_mapping)
        slot_mapping[50:] += 200  # in place, as a runner reusing its step buffers would
        key_cache, value_cache, expected_key_cache, expected_value_cache = kv_write(slot_mapping)
    assert torch.equal(key_cache, expected_key_cache) and torch.equal(value_cache, expected_value_cache)
