"""GGUF block formats kept as blocks: the torch reference against gguf-py, the Triton kernel
(under TRITON_INTERPRET on the CPU) and the tiled CPU path against the reference, and a tiny Llama
GGUF holding all eight types loaded with ``quantization="gguf"``: the same greedy tokens and
log-probabilities as the same file dequantized at load, its linear weights resident in the file's
bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.loader import load_checkpoint
from hearth_llm.engine.models.linear import linear_layers
from hearth_llm.engine.models.quant import GGUFBlockLinearMethod
from hearth_llm.kernels.quant import BLOCK_FORMATS, GGUF_TYPES, gguf_cpu, gguf_cpu_native, gguf_reference

from conftest import TINY_VOCAB, random_prompts
from gguf_writer import add_block_layers, tiny_llama_writer, write_and_close

TYPES = sorted(BLOCK_FORMATS)  # llama.cpp's eight and W4G128 (AWQ/GPTQ repacked)
# The float16 fields of each block (scales, minimums), by byte offset.
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [208], "W4G128": [0]}


def random_blocks(quant_type: str, num_rows: int, num_columns: int, seed: int = 0, scale: float = 1e-3):
    """Random block rows whose float16 fields are small positive scales (random bytes elsewhere:
    every code, 6-bit scale and high bit pattern occurs)."""
    fmt = BLOCK_FORMATS[quant_type]
    generator = torch.Generator().manual_seed(seed)
    num_blocks = num_columns // fmt.block_size
    data = torch.randint(0, 256, (num_rows, num_blocks, fmt.type_size), dtype=torch.uint8, generator=generator)
    for offset in F16_FIELDS[quant_type]:
        values = (torch.rand(num_rows, num_blocks, 1, generator=generator) + 0.5) * scale
        data[..., offset:offset + 2] = values.half().view(torch.uint8)
    return data.reshape(num_rows, -1)


@pytest.mark.parametrize("quant_type", GGUF_TYPES)
def test_reference_dequantize_is_bit_equal_to_gguf_py(quant_type):
    # Raw random bytes, float16 fields included (NaN and inf scales too): every bit must agree.
    fmt = BLOCK_FORMATS[quant_type]
    data = torch.randint(0, 256, (5, 3 * fmt.type_size), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    expected = gguf_dequantize(data.numpy(), GGMLQuantizationType[quant_type]).reshape(5, -1).astype(np.float32)
    ours = gguf_reference.dequantize(data, quant_type)
    assert ours.dtype == torch.float32 and ours.shape == (5, 3 * fmt.block_size)
    expected = torch.from_numpy(expected)
    # NaNs (from NaN/inf scales) agree in position; their sign bits follow the CPU's SIMD path.
    assert torch.equal(ours.isnan(), expected.isnan())
    numbers = ~expected.isnan()
    assert torch.equal(ours[numbers].view(torch.int32), expected[numbers].view(torch.int32))


def test_reference_refuses_an_unknown_type_and_partial_blocks():
    with pytest.raises(ValueError, match="Q3_K.*supported"):
        gguf_reference.dequantize(torch.zeros(2, 110, dtype=torch.uint8), "Q3_K")
    with pytest.raises(ValueError, match="34-byte"):
        gguf_reference.dequantize(torch.zeros(2, 35, dtype=torch.uint8), "Q8_0")


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("num_rows", [3, 19])  # the GEMV kernel (<= 4 rows) and the tiled GEMM
def test_triton_kernel_matches_the_reference(quant_type, num_rows):
    from hearth_llm.kernels.quant import gguf_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs Triton's interpreter
    num_columns = 2 * BLOCK_FORMATS[quant_type].block_size
    data = random_blocks(quant_type, 40, num_columns, seed=num_rows)  # 40 rows: a partial tile of outputs
    generator = torch.Generator().manual_seed(2)
    x, bias = torch.randn(num_rows, num_columns, generator=generator), torch.randn(40, generator=generator)
    expected = gguf_reference.gguf_linear(x, data, quant_type, bias)
    out = gguf_triton.gguf_linear(x.to(device), data.to(device), quant_type, bias.to(device)).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("quant_type", ["Q4_K", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_tiled_path_matches_the_reference(quant_type, dtype):
    data = random_blocks(quant_type, 70, 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(70).to(dtype)
    expected = gguf_reference.gguf_linear(x, data, quant_type, bias)
    out = gguf_cpu.gguf_linear(x, data, quant_type, bias, tile_elements=16 * 512)  # 5 tiles, the last partial
    if dtype == torch.float32:
        # Bit-equal tiles (the C decoder), but MKL's sgemm can sum a 16-row tile in another order than
        # the 70-row whole weight (its AVX2 kernels do, also on AMD CPUs with AVX-512): float32 rounding
        # of 512-term sums, ~4e-7 of the largest output (Q6_K: 5e-5 at 117), both equally far from float64's
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())
    else:  # each tile is rounded to bf16 like the whole weight: products agree to bf16's output rounding
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


# --- a tiny Llama GGUF with every type --------------------------------------------------------

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
# Per layer: (q, k, v, o, gate, up, down). Layer 0's fused qkv mixes Q4_K and Q6_K, as Q4_K_M files do.
LAYER_TYPES = [("Q4_K", "Q4_K", "Q6_K", "Q5_K", "Q4_0", "Q4_1", "Q8_0"),
               ("Q5_0", "Q5_0", "Q5_1", "Q8_0", "Q6_K", "Q6_K", "Q5_K")]


def _shape(name: str) -> tuple[int, int]:
    kv_rows = KV_HEADS * HEAD_DIM
    return {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv_rows, HIDDEN), "attn_v": (kv_rows, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
            "ffn_down": (HIDDEN, INTERMEDIATE)}[name]


def _quantized(quant_type: str, shape, seed: int) -> np.ndarray:
    if quant_type.endswith("_K"):  # gguf-py has no K-quant quantizer: hand-built blocks
        scale = {"Q4_K": 4e-4, "Q5_K": 2e-4, "Q6_K": 1e-4}[quant_type]
        return random_blocks(quant_type, *shape, seed=seed, scale=scale).numpy()
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.15
    return gguf_reference.quantize(weight, quant_type).numpy()


def _layer_blocks(quant_type: str, name: str, seed: int) -> np.ndarray:
    """The blocks of linear tensor ``name`` of the tiny Llama (for ``gguf_writer.add_block_layers``)."""
    return _quantized(quant_type, _shape(name), seed)


@pytest.fixture(scope="module")
def all_types_gguf(tmp_path_factory):
    """The file and the bytes of its linear tensors."""
    path = tmp_path_factory.mktemp("quant") / "all-types.gguf"
    writer = tiny_llama_writer(path, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS)
    generator = torch.Generator().manual_seed(0)
    writer.add_tensor("token_embd.weight", (torch.randn(TINY_VOCAB, HIDDEN, generator=generator)).numpy())
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor("output.weight", _quantized("Q8_0", (TINY_VOCAB, HIDDEN), seed=99),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    linear_bytes = sum(add_block_layers(writer, LAYER_TYPES, HIDDEN, _layer_blocks).values())
    write_and_close(writer)
    return path, linear_bytes


def _greedy(path, **kwargs):
    """Three prompts batched (decode steps of 3 rows: the tiled path), then one alone (1 row: numba's GEMV)."""
    prompts = random_prompts(4, [5, 17, 1, 9], seed=21)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    with LLM(str(path), dtype="float32", device="cpu", show_progress=False, **kwargs) as llm:
        outputs = llm.generate(prompts[:3], params, use_tqdm=False) + llm.generate(prompts[3:], params, use_tqdm=False)
        layers = list(linear_layers(llm.engine.runner.model))
        return outputs, layers


def _token_logprobs(output):
    return [step[token].logprob for token, step in zip(output.token_ids, output.logprobs)]


def test_every_block_type_runs_from_its_blocks_like_the_dequantized_file(all_types_gguf, monkeypatch):
    path, linear_bytes = all_types_gguf
    blocks, block_layers = _greedy(path, quantization="gguf")
    # the reference dequantizes every layer at load (by default float32 keeps the blocks of layers whose
    # types all have a vectorized float32 GEMV)
    monkeypatch.setattr(gguf_cpu_native, "has_vector_float32", lambda quant_type: False)
    dense, dense_layers = _greedy(path)
    decoder_layers = [layer for name, layer in block_layers if name.startswith("layers.")]
    assert all(isinstance(layer.method, GGUFBlockLinearMethod) for layer in decoder_layers)
    assert not any(isinstance(layer.method, GGUFBlockLinearMethod) for _, layer in dense_layers)
    for ours, reference in zip(blocks, dense):
        assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
        np.testing.assert_allclose(_token_logprobs(ours.outputs[0]), _token_logprobs(reference.outputs[0]), atol=1e-4)
    resident = sum(layer.method.resident_bytes(layer) for layer in decoder_layers)
    assert resident == linear_bytes  # the file's bytes, no copy (limit: 1.15x)
    mixed_qkv = dict(block_layers)["layers.0.self_attn.qkv_proj"]
    assert [weight.quant_type for weight in mixed_qkv.method.block_weights(mixed_qkv)] == ["Q4_K", "Q6_K"]


def test_quantization_gguf_is_refused_for_a_checkpoint_without_blocks(tmp_path):
    from conftest import TINY_CONFIGS
    from model_equality import save_tiny_model

    path = save_tiny_model(TINY_CONFIGS["llama"](), tmp_path / "llama")
    with pytest.raises(ValueError, match="quantization='gguf' needs a GGUF file"):
        LLM(str(path), device="cpu", quantization="gguf", show_progress=False)


def test_unknown_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization must be None or one of .*'awq'"):
        LLM("default", device="cpu", quantization="awq", show_progress=False)


def test_hf_quantization_config_not_implemented_is_refused_before_weights_are_read(tmp_path):
    import json

    from conftest import TINY_CONFIGS
    from model_equality import save_tiny_model

    from hearth_llm.engine.loader.model_loader import load_model

    path = save_tiny_model(TINY_CONFIGS["llama"](), tmp_path / "llama")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config))
    checkpoint = load_checkpoint(str(path), torch.float32)
    checkpoint.weights = lambda: pytest.fail("weights were read before the refusal")
    with pytest.raises(ValueError, match="quantization_config.quant_method='bitsandbytes' is not supported"):
        load_model(checkpoint, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("quant_type", TYPES)
def test_numba_gemv_matches_the_reference(quant_type):
    pytest.importorskip("numba")  # the optional CPU kernel (hearth-llm[quant-cpu]; in dev)
    from hearth_llm.kernels.quant import gguf_numba

    num_columns = 2 * BLOCK_FORMATS[quant_type].block_size
    data = random_blocks(quant_type, 33, num_columns, seed=4)
    x = torch.randn(2, num_columns, generator=torch.Generator().manual_seed(5))
    expected = gguf_reference.gguf_linear(x, data, quant_type)
    out = gguf_numba.gguf_gemv(x, data, quant_type)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
