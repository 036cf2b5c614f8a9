"""The float32 GGUF path of CPUs without AVX-512 BF16 (AVX2 + FMA + F16C): Q4_0/Q4_1/Q8_0 blocks
repacked into panels of 8 output rows (the same bytes), their GEMV against the reference decoders
(bit-equal dequantization, exact-weight sums, each row's bits independent of the batch), the AVX2
row GEMV on the file's own rows, and a tiny all-Q4 Llama GGUF loaded in float32: its linears on
panels, its Q8_0 embedding and head kept as blocks, its greedy tokens equal to HF transformers' on
the dequantized weights. Skips where the kernels are not built or the CPU lacks AVX2/FMA/F16C."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.loader import load_checkpoint
from hearth_llm.engine.models.cpu_weights import CpuBlockEmbedding, CpuBlockLogitsHead, int4_layout_is_the_tiles_one
from hearth_llm.engine.models.gguf_linear_method import GGUFInt4LinearMethod
from hearth_llm.engine.models.linear import linear_layers
from hearth_llm.kernels.quant import BLOCK_FORMATS, gguf_cpu_native, gguf_reference

from conftest import TINY_VOCAB, hf_greedy, random_prompts
from gguf_writer import add_q8_0_embedding_and_norm, add_block_layers, tiny_llama_writer, write_and_close
from test_quant_gguf import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, _layer_blocks, random_blocks

PANEL_TYPES = list(gguf_cpu_native.PANEL_TYPES)
pytestmark = pytest.mark.skipif(not gguf_cpu_native.available() or not gguf_cpu_native.has_panels("Q4_1"),
                                reason="no panel kernels here (no C compiler, or no AVX2/FMA/F16C)")


def _exact(x: torch.Tensor, data: torch.Tensor, quant_type: str) -> torch.Tensor:
    return x.double() @ gguf_reference.dequantize(data, quant_type).double().T


@pytest.mark.parametrize("quant_type", PANEL_TYPES)
def test_panels_are_the_blocks_bytes_rearranged_and_decode_bit_equal(quant_type):
    data = random_blocks(quant_type, 40, 96, seed=1)
    panels = gguf_cpu_native.pack_panels(data, quant_type)
    assert panels.dtype == torch.uint8 and panels.numel() == data.numel()
    assert torch.equal(torch.sort(panels.flatten()).values, torch.sort(data.flatten()).values)
    expected = gguf_reference.dequantize(data, quant_type)
    assert torch.equal(gguf_cpu_native.dequantize_panels(panels, quant_type).view(torch.int32),
                       expected.view(torch.int32))
    assert torch.equal(gguf_cpu_native.unpack_panels(panels, quant_type), data)  # the blocks back (int8 panels' source)


@pytest.mark.parametrize("quant_type", PANEL_TYPES)
def test_panel_gemv_multiplies_the_exact_weights_for_each_row_count_and_thread_count(quant_type):
    data = random_blocks(quant_type, 56, 160, seed=2)  # 56 rows: 7 panels, a thread's partial chunk
    gemv = gguf_cpu_native.panel_gemv_routine(gguf_cpu_native.pack_panels(data, quant_type), quant_type)
    x = torch.randn(8, 160, generator=torch.Generator().manual_seed(3))
    for rows in range(1, 9):
        out, expected = gemv(x[:rows].contiguous()), _exact(x[:rows], data, quant_type)
        assert out.dtype == torch.float32 and out.shape == (rows, 56)
        # float32 sums of the exactly decoded weights: only where the roundings fall differs from float64
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6 * expected.abs().max().item())
    # 2056 rows: more than one chunk of 16 rows per thread, and a partial last chunk
    big = random_blocks(quant_type, 2056, 1024, seed=9)
    big_gemv = gguf_cpu_native.panel_gemv_routine(gguf_cpu_native.pack_panels(big, quant_type), quant_type)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(10))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = big_gemv(x)
        torch.set_num_threads(1)
        assert torch.equal(two, big_gemv(x))  # panels split over threads, same sums
    finally:
        torch.set_num_threads(threads)
    expected = _exact(x, big, quant_type)
    torch.testing.assert_close(two.double(), expected, rtol=0, atol=2e-6 * expected.abs().max().item())


@pytest.mark.parametrize("quant_type", PANEL_TYPES)
def test_panel_gemv_gives_each_row_the_same_bits_in_any_batch(quant_type):
    data = random_blocks(quant_type, 32, 256, seed=4)
    gemv = gguf_cpu_native.panel_gemv_routine(gguf_cpu_native.pack_panels(data, quant_type), quant_type)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([gemv(x[i:i + 1].contiguous()) for i in range(8)])
    for rows in range(2, 9):
        assert torch.equal(gemv(x[:rows].contiguous()), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("quant_type", [*PANEL_TYPES, "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_avx2_row_gemv_gives_each_row_the_same_bits_in_any_batch(quant_type):
    if gguf_cpu_native.has_avx512():
        pytest.skip("AVX-512 build: its float32 GEMV keeps fewer accumulators for more rows")
    assert gguf_cpu_native.has_vector_float32(quant_type)  # the AVX2 kernel, not the scalar decoders
    num_columns = 2 * BLOCK_FORMATS[quant_type].block_size
    data = random_blocks(quant_type, 24, num_columns, seed=6)
    x = torch.randn(8, num_columns, generator=torch.Generator().manual_seed(7))
    alone = torch.cat([gguf_cpu_native.gemv(x[i:i + 1], data, quant_type) for i in range(8)])
    for rows in range(2, 9):
        assert torch.equal(gguf_cpu_native.gemv(x[:rows], data, quant_type), alone[:rows]), f"{rows} rows"


def test_panels_refuse_bad_inputs_by_name():
    with pytest.raises(ValueError, match="multiples of 8"):
        gguf_cpu_native.pack_panels(random_blocks("Q4_1", 12, 64), "Q4_1")
    with pytest.raises(ValueError, match="Q4_0/Q4_1/Q8_0"):
        gguf_cpu_native.pack_panels(random_blocks("Q4_K", 8, 256), "Q4_K")
    with pytest.raises(ValueError, match="no panel kernel for Q6_K"):
        gguf_cpu_native.panel_gemv_routine(torch.zeros(1, 8 * 210, dtype=torch.uint8), "Q6_K")
    with pytest.raises(ValueError, match="pack_panels"):
        gguf_cpu_native.panel_gemv_routine(torch.zeros(1, 7, dtype=torch.uint8), "Q4_1")


# Layer 1: a qkv of Q4_0, Q4_0, Q8_0 runs and a Q8_0 down projection (Q8_0 layers take panels too).
Q4_LAYER_TYPES = [("Q4_1", "Q4_1", "Q4_1", "Q4_0", "Q4_0", "Q4_1", "Q4_1"),
                  ("Q4_0", "Q4_0", "Q8_0", "Q4_1", "Q4_1", "Q4_1", "Q8_0")]


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    """A tiny Llama of Q4_0/Q4_1/Q8_0 linears and a tied Q8_0 embedding (as the bundled SmolLM2), and an HF
    directory of its dequantized weights."""
    root = tmp_path_factory.mktemp("gguf_panels")
    path = root / "q4.gguf"
    writer = tiny_llama_writer(path, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS)
    embedding = add_q8_0_embedding_and_norm(writer, TINY_VOCAB, HIDDEN)
    add_block_layers(writer, Q4_LAYER_TYPES, HIDDEN, _layer_blocks)
    write_and_close(writer)
    checkpoint = load_checkpoint(str(path), torch.float32, progress=False)
    hf_dir = root / "dequantized-hf"
    checkpoint.config.save_pretrained(hf_dir)
    tensors = {name: (t.dequantized(torch.float32) if hasattr(t, "dequantized") else t).contiguous()
               for name, t in checkpoint.weights()}
    save_file(tensors, str(hf_dir / "model.safetensors"))
    return path, hf_dir


def test_float32_load_runs_q4_layers_on_panels_and_matches_hf_on_the_dequantized_weights(q4_file, monkeypatch):
    from hearth_llm.engine.loader.gguf_blocks import GGUFBlocks

    path, hf_dir = q4_file
    prompts = random_prompts(3, [5, 40, 2], seed=31)  # 40 tokens: a prefill on tiles decoded from the panels
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    dequantized_shapes = []
    dequantized = GGUFBlocks.dequantized

    def counting(self, dtype):
        dequantized_shapes.append(tuple(self.shape))
        return dequantized(self, dtype)

    monkeypatch.setattr(GGUFBlocks, "dequantized", counting)
    with LLM(str(path), dtype="float32", device="cpu", show_progress=False) as llm:
        # the panels are the layers' only copy, so the load dequantizes no linear (a 1B Q8_0 file's load: 17.6 s
        # -> 5.7 s); what it does dequantize is the embedding's rows, not a layer's
        assert all(shape[0] == TINY_VOCAB for shape in dequantized_shapes), dequantized_shapes
        model = llm.engine.runner.model
        for name, layer in linear_layers(model):
            assert isinstance(layer.method, GGUFInt4LinearMethod), name
            runs = layer.method.panel_runs(layer)
            assert runs and all(panels.dtype == torch.uint8 for _, panels in runs), name
            assert "weight" not in layer._parameters  # no dense copy: batches decode tiles of the panels
            assert layer.method.resident_bytes(layer) == sum(panels.numel() for _, panels in runs)
        qkv = dict(linear_layers(model))["layers.0.self_attn.qkv_proj"]
        assert [quant_type for quant_type, _ in qkv.method.panel_runs(qkv)] == ["Q4_1"]
        qkv1 = dict(linear_layers(model))["layers.1.self_attn.qkv_proj"]
        assert [quant_type for quant_type, _ in qkv1.method.panel_runs(qkv1)] == ["Q4_0", "Q8_0"]
        assert isinstance(model.lm_head, CpuBlockLogitsHead) and isinstance(model.embed_tokens, CpuBlockEmbedding)
        assert model.lm_head.blocks.data_ptr() == model.embed_tokens.blocks.data_ptr()  # one tied copy
        outputs = llm.generate(prompts[:2], params, use_tqdm=False) + llm.generate(prompts[2:], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_dir, prompt, 6), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("tile_elements", [None, 8 * HIDDEN])  # 8 x HIDDEN: one panel a tile
def test_panel_layer_routine_equals_the_dequantized_weight_for_steps_and_batches(q4_file, monkeypatch, tile_elements):
    from hearth_llm.engine.models import gguf_linear_method

    if tile_elements is not None:
        monkeypatch.setattr(gguf_linear_method, "PANEL_TILE_ELEMENTS", tile_elements)
    path, _ = q4_file
    blocks = load_checkpoint(str(path), torch.float32, progress=False)
    shards = dict(blocks.weights())
    weight = torch.cat([shards[f"model.layers.0.mlp.{name}.weight"].dequantized(torch.float32)
                        for name in ("gate_proj", "up_proj")])
    with LLM(str(path), dtype="float32", device="cpu", show_progress=False) as llm:
        layer = dict(linear_layers(llm.engine.runner.model))["layers.0.mlp.gate_up_proj"]  # runs Q4_0 + Q4_1
        assert [quant_type for quant_type, _ in layer.method.panel_runs(layer)] == ["Q4_0", "Q4_1"]
        generator = torch.Generator().manual_seed(8)
        for rows in (1, 3, 8, 20, 64):  # 20, 64: batches on the tiles
            x = torch.randn(rows, HIDDEN, generator=generator)
            expected = x.double() @ weight.double().T
            torch.testing.assert_close(layer(x).double(), expected, rtol=0, atol=2e-6 * expected.abs().max().item())


def test_without_the_c_kernels_a_bf16_q8_0_layer_keeps_its_dense_copy(q4_file, monkeypatch):
    """No C compiler: Q4 layers take the int4 kernel; a layer with a Q8_0 shard (int4 cannot hold it)
    multiplies its dense copy of the dequantized weight, all rows."""
    path, _ = q4_file
    monkeypatch.setattr(gguf_cpu_native, "_library", lambda: None)
    with LLM(str(path), dtype="bfloat16", device="cpu", show_progress=False) as llm:
        layers = dict(linear_layers(llm.engine.runner.model))
        down = layers["layers.1.mlp.down_proj"]  # Q8_0
        assert isinstance(down.method, GGUFInt4LinearMethod) and down.method.block_runs(down) is None
        assert down.cpu_weight is None or down.cpu_weight.int4 is None
        assert layers["layers.0.mlp.down_proj"].cpu_weight.int4 is not None  # Q4_1: the int4 kernel
        blocks = load_checkpoint(str(path), torch.float32, progress=False)
        weight = dict(blocks.weights())["model.layers.1.mlp.down_proj.weight"].dequantized(torch.float32)
        x = torch.randn(3, INTERMEDIATE, generator=torch.Generator().manual_seed(2)).bfloat16()
        expected = x.float() @ weight.bfloat16().float().T
        torch.testing.assert_close(down(x).float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
        outputs = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                               use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3
    int4_layout_is_the_tiles_one.cache_clear()  # in case it was asked while the kernels were "missing"
