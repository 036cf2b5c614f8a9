"""AWQ (GEMM) and GPTQ (desc_act=False) 4-bit checkpoints: a tiny Llama quantized here, packed as
AutoAWQ and AutoGPTQ pack (their published packing loops, written out independently of our
unpacker), runs token-equal to HF transformers on the same model with the dequantized weights
``s * (q - z)`` (fp32); its layers stay in W4G128 blocks; unsupported fields are refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.models.linear import linear_layers
from hearth_llm.engine.models.quant import GGUFBlockLinearMethod

from conftest import TINY_COMMON, hf_greedy, random_prompts
from model_equality import save_tiny_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 128
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's WQLinear_GEMM.from_linear


def quantize_groups(weight: torch.Tensor):
    """Asymmetric 4-bit per group of 128 inputs: codes [N, K], fp16 scales and zeros [N, K / 128]."""
    groups = weight.reshape(weight.shape[0], -1, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-5).half()
    zeros = (-low / scales.float()).round().clamp(0, 15)
    codes = (groups / scales.float()[..., None]).round().add(zeros[..., None]).clamp(0, 15)
    return codes.reshape(weight.shape).int(), scales, zeros.int()


def dequantized(codes, scales, zeros):
    groups = codes.reshape(codes.shape[0], -1, GROUP).float()
    return ((groups - zeros[..., None].float()) * scales.float()[..., None]).reshape(codes.shape)


def awq_pack(codes, scales, zeros):
    """AutoAWQ: qweight [K, N/8], qzeros [K/128, N/8] (8 output columns per int32 word), scales [K/128, N]."""
    intweight, intzeros = codes.t().contiguous(), zeros.t().contiguous()
    qweight = torch.zeros(intweight.shape[0], intweight.shape[1] // 8, dtype=torch.int32)
    qzeros = torch.zeros(intzeros.shape[0], intzeros.shape[1] // 8, dtype=torch.int32)
    for col in range(qweight.shape[1]):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_PACK_ORDER[i]] << (i * 4)
            qzeros[:, col] |= intzeros[:, col * 8 + AWQ_PACK_ORDER[i]] << (i * 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous()}


def gptq_pack(codes, scales, zeros):
    """AutoGPTQ (v1): qweight [K/8, N] (8 inputs per word), qzeros [K/128, N/8] holding zeros - 1, g_idx."""
    intweight, intzeros = codes.t().contiguous(), (zeros - 1).t().contiguous()
    qweight = torch.zeros(intweight.shape[0] // 8, intweight.shape[1], dtype=torch.int32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << (4 * j)
    qzeros = torch.zeros(intzeros.shape[0], intzeros.shape[1] // 8, dtype=torch.int32)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= (intzeros[:, col * 8 + j] & 0xF) << (4 * j)
    g_idx = torch.arange(codes.shape[1], dtype=torch.int32) // GROUP
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous(), "g_idx": g_idx}


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
               "checkpoint_format": "gptq"}


def write_int4_dirs(config, root) -> dict:
    """A tiny model of ``config`` with random weights, written three times under ``root``: ``"dense"``
    with each linear's dequantized weights (the reference HF runs), ``"awq"`` and ``"gptq"`` with the
    same groups packed as AutoAWQ / AutoGPTQ pack them and their ``quantization_config``."""
    source = save_tiny_model(config, root / "source", std=0.05)
    tensors = load_file(source / "model.safetensors")
    dense, packed = dict(tensors), {"awq": dict(tensors), "gptq": dict(tensors)}
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in LINEARS]:
        prefix = name[:-len(".weight")]
        parts = quantize_groups(tensors[name])
        dense[name] = dequantized(*parts)
        for method, pack in (("awq", awq_pack), ("gptq", gptq_pack)):
            del packed[method][name]
            packed[method].update({f"{prefix}.{part}": value for part, value in pack(*parts).items()})
    dirs = {}
    for method, method_tensors in [("dense", dense)] + list(packed.items()):
        path = root / method
        path.mkdir()
        for file in source.iterdir():
            if file.name != "model.safetensors":
                (path / file.name).write_bytes(file.read_bytes())
        save_file(method_tensors, path / "model.safetensors")
        if method != "dense":
            hf_config = json.loads((path / "config.json").read_text())
            hf_config["quantization_config"] = AWQ_CONFIG if method == "awq" else GPTQ_CONFIG
            (path / "config.json").write_text(json.dumps(hf_config))
        dirs[method] = path
    return dirs


@pytest.fixture(scope="module")
def quantized_dirs(tmp_path_factory):
    """(dense dir with the dequantized weights, {"awq": dir, "gptq": dir}, bytes of the linear parts)."""
    root = tmp_path_factory.mktemp("int4")
    config = LlamaConfig(**{**TINY_COMMON, "hidden_size": 128, "intermediate_size": 256}, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    return write_int4_dirs(config, root)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoint_runs_token_equal_to_hf_on_the_dequantized_model(quantized_dirs, method):
    prompts = random_prompts(3, [6, 21, 2], seed=41)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(quantized_dirs[method]), dtype="float32", device="cpu", show_progress=False) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params, use_tqdm=False)
        layers = [layer for name, layer in linear_layers(llm.engine.runner.model) if name.startswith("layers.")]
    assert all(isinstance(layer.method, GGUFBlockLinearMethod) for layer in layers)
    resident = sum(layer.method.resident_bytes(layer) for layer in layers)
    weights = sum(layer.output_size * layer.input_size for layer in layers)
    assert resident == weights // GROUP * 68  # 4.25 bits per weight: codes, fp16 scale, zero per 128
    for prompt, output in zip(prompts + prompts[:1], outputs):
        assert output.outputs[0].token_ids == hf_greedy(quantized_dirs["dense"], prompt, 8)


@pytest.mark.parametrize("field, value", [("bits", 8), ("group_size", 64), ("checkpoint_format", "gptq_v2")])
def test_gptq_fields_we_do_not_run_are_refused_by_name(quantized_dirs, tmp_path, field, value):
    path = tmp_path / "gptq"
    path.mkdir()
    for file in quantized_dirs["gptq"].iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"][field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"quantization_config.{field}={value!r} is not supported"):
        LLM(str(path), device="cpu", show_progress=False)


@pytest.mark.parametrize("num_rows", [1, 3, 20])  # the GEMV, and the tl.dot GEMM
def test_word_wise_w4g128_kernel_matches_the_reference(num_rows):
    """kernels/quant/triton_w4g128.py (TRITON_INTERPRET here; tests/test_gpu_quant.py on the H200)."""
    from hearth_llm.kernels.quant import gguf_reference, triton_w4g128

    generator = torch.Generator().manual_seed(num_rows)
    codes = torch.randint(0, 16, (40, 256), generator=generator)
    scales = (torch.rand(40, 2, generator=generator) * 0.1).half()
    zeros = torch.randint(0, 16, (40, 2), generator=generator)
    data = gguf_reference.pack_w4g128(codes, scales, zeros)
    x, bias = torch.randn(num_rows, 256, generator=generator), torch.randn(40, generator=generator)
    expected = gguf_reference.gguf_linear(x, data, "W4G128", bias)
    out = triton_w4g128.w4g128_linear(x, data, bias, block_n=16, groups_per_iter=4)  # 2 groups: one iteration half masked
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(triton_w4g128.dequantize(data, torch.float32), gguf_reference.dequantize(data, "W4G128"),
                               rtol=0, atol=0)


@pytest.mark.parametrize("variant, num_rows, split_k", [("j4", 1, 1), ("j4", 4, 2), ("v1", 3, 1), ("v1", 2, 3)])
def test_w4g128_gemv_variants_match_the_reference(variant, num_rows, split_k):
    """Both GEMV layouts of triton_w4g128 (the mantissa-trick decode), several rows per program, and
    split-K (float32 atomics, then the cast) with a split that leaves one program's groups short."""
    from hearth_llm.kernels.quant import gguf_reference, triton_w4g128

    generator = torch.Generator().manual_seed(7 + num_rows)
    codes = torch.randint(0, 16, (24, 384), generator=generator)
    scales = (torch.rand(24, 3, generator=generator) * 0.1).half()
    zeros = torch.randint(0, 16, (24, 3), generator=generator)
    data = gguf_reference.pack_w4g128(codes, scales, zeros)
    x, bias = torch.randn(num_rows, 384, generator=generator), torch.randn(24, generator=generator)
    expected = gguf_reference.gguf_linear(x, data, "W4G128", bias)
    out = triton_w4g128.w4g128_linear(x, data, bias, gemv_max_rows=4, block_n=16, groups_per_iter=2,
                                      split_k=split_k, variant=variant, num_warps=1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


# Layers that read the same input share one act-order permutation (GPTQ orders by that input's statistics).
INPUT_SETS = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o", "gate_proj": "mlp_in",
              "up_proj": "mlp_in", "down_proj": "down"}


def test_gptq_act_order_checkpoint_runs_token_equal_to_hf_on_the_dequantized_model(tmp_path):
    """desc_act=True: each group is 128 inputs anywhere in the row (g_idx), repacked by sorting the
    inputs by group; the layer gathers its inputs in that order."""
    config = LlamaConfig(**{**TINY_COMMON, "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 1},
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    source = save_tiny_model(config, tmp_path / "source", std=0.05)
    tensors = load_file(source / "model.safetensors")
    dense, packed = dict(tensors), dict(tensors)
    generator = torch.Generator().manual_seed(5)
    orders = {}
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in LINEARS]:
        prefix, weight = name[:-len(".weight")], tensors[name]
        key = (name.split(".")[2], INPUT_SETS[name.rsplit(".", 2)[-2]])
        order = orders.setdefault(key, torch.randperm(weight.shape[1], generator=generator))
        codes, scales, zeros = quantize_groups(weight[:, order])   # groups of the sorted columns
        restore = torch.argsort(order)
        dense[name] = dequantized(codes, scales, zeros)[:, restore]
        parts = gptq_pack(codes[:, restore], scales, zeros)
        parts["g_idx"] = (restore // GROUP).to(torch.int32)        # the group of each input, in its own order
        del packed[name]
        packed.update({f"{prefix}.{part}": value for part, value in parts.items()})
    for method, method_tensors in (("dense", dense), ("gptq", packed)):
        (tmp_path / method).mkdir()
        for file in source.iterdir():
            if file.name != "model.safetensors":
                (tmp_path / method / file.name).write_bytes(file.read_bytes())
        save_file(method_tensors, tmp_path / method / "model.safetensors")
    hf_config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    hf_config["quantization_config"] = {**GPTQ_CONFIG, "desc_act": True}
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(hf_config))
    prompts = random_prompts(2, [9, 4], seed=43)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(tmp_path / "gptq"), dtype="float32", device="cpu", show_progress=False) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        layers = [layer for name, layer in linear_layers(llm.engine.runner.model) if name.startswith("layers.")]
    assert all(getattr(layer, "gguf_input_order", None) is not None for layer in layers)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(tmp_path / "dense", prompt, 6)


def test_gptq_act_order_groups_of_the_wrong_size_are_refused_by_layer():
    from hearth_llm.engine.models.quant.awq_gptq import _input_order

    g_idx = torch.arange(256) // 128
    g_idx[0] = 1  # group 0 has 127 inputs, group 1 has 129
    with pytest.raises(ValueError, match="layers.0.mlp.down_proj.g_idx must give each of its 2 groups exactly 128"):
        _input_order("layers.0.mlp.down_proj", g_idx)


def random_w4_rows(num_rows: int, num_columns: int, seed: int) -> torch.Tensor:
    from hearth_llm.kernels.quant import gguf_reference

    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (num_rows, num_columns), generator=generator)
    scales = (torch.rand(num_rows, num_columns // GROUP, generator=generator) * 0.1).half()
    zeros = torch.randint(0, 16, (num_rows, num_columns // GROUP), generator=generator)
    return gguf_reference.pack_w4g128(codes, scales, zeros)


def test_w4_layout_is_an_exact_repacking_of_w4g128_rows():
    """kernels/quant/w4_layout.py: codes and headers split out of the rows and back, bit for bit,
    every weight's value unchanged; nibble i of word 16 g + c is input 128 g + 16 i + c."""
    from hearth_llm.kernels.quant import gguf_reference, w4_layout

    rows = random_w4_rows(24, 384, seed=3)
    weight = w4_layout.from_rows(rows)
    assert weight.codes.shape == (24, 48) and weight.headers.shape == (3, 24)
    assert weight.codes.numel() * 4 + weight.headers.numel() * 4 == rows.numel()  # the same 68 bytes a group
    assert torch.equal(w4_layout.to_rows(weight), rows)
    assert torch.equal(w4_layout.dequantize(weight), gguf_reference.dequantize(rows, "W4G128"))
    nibble_2_of_word_5 = (weight.codes[:, 16 + 5] >> 8) & 0xF
    assert torch.equal(nibble_2_of_word_5.to(torch.uint8), w4_layout.code_columns(weight)[:, 128 + 32 + 5])


@pytest.mark.parametrize("num_rows, split_k, prefetch, groups_per_iter",
                         [(1, 1, True, 2), (1, 3, True, 2), (1, 1, True, 1), (1, 3, False, 1), (3, 2, False, 2)])
def test_w4_cuda_core_gemv_matches_the_reference(num_rows, split_k, prefetch, groups_per_iter):
    """triton_w4.gemv (TRITON_INTERPRET here; tests/test_gpu_w4.py on CUDA): float32 x, a bias,
    split-K over programs whose last one reduces (3 groups in 3 parts; 2 parts of 2 and 1); the
    one-row kernel with prefetch (two groups a step: an odd tail) and the one without."""
    from hearth_llm.kernels.quant import triton_w4, w4_layout

    weight = w4_layout.from_rows(random_w4_rows(40, 384, seed=num_rows))
    generator = torch.Generator().manual_seed(11)
    x, bias = torch.randn(num_rows, 384, generator=generator), torch.randn(40, generator=generator)
    expected = w4_layout.reference_linear(x, weight, bias)
    for _ in range(2):  # the second call finds the split workspace the first one left (zeroed)
        out = triton_w4.gemv(x, weight, bias, split_k=split_k, block_n=16, prefetch=prefetch,
                             groups_per_iter=groups_per_iter)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("num_rows, split_k, groups_per_iter", [(1, 1, 1), (5, 2, 2), (16, 3, 1)])
def test_w4_tensor_core_gemv_matches_the_reference(num_rows, split_k, groups_per_iter):
    """triton_w4.dot_gemv on float16 x (the interpreter's tl.dot mishandles bfloat16; the GPU test
    runs bfloat16): code - zero are exact in x's dtype, each group's dot is scaled in float32."""
    from hearth_llm.kernels.quant import triton_w4, w4_layout

    weight = w4_layout.from_rows(random_w4_rows(40, 384, seed=num_rows))
    generator = torch.Generator().manual_seed(12)
    x, bias = torch.randn(num_rows, 384, generator=generator).half(), torch.randn(40, generator=generator).half()
    expected = w4_layout.reference_linear(x.float(), weight, bias.float())
    out = triton_w4.dot_gemv(x, weight, bias, split_k=split_k, block_n=16, groups_per_iter=groups_per_iter)
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3 * expected.abs().max().item())


@pytest.mark.parametrize("split_k, groups_per_iter", [(1, 2), (2, 2), (1, 4)])
def test_w4_row_gemv_matches_the_reference(split_k, groups_per_iter):
    """triton_w4.row_gemv (the whole-K one-row kernel; TRITON_INTERPRET here): a bias, 3 groups in
    steps of 2 (a tail step) or 4, unsplit or in 2 parts, called twice (the split workspace)."""
    from hearth_llm.kernels.quant import triton_w4, w4_layout

    weight = w4_layout.from_rows(random_w4_rows(40, 384, seed=6))
    generator = torch.Generator().manual_seed(13)
    x, bias = torch.randn(1, 384, generator=generator), torch.randn(40, generator=generator)
    expected = w4_layout.reference_linear(x, weight, bias)
    for _ in range(2):
        out = triton_w4.row_gemv(x, weight, bias, split_k=split_k, block_n=16, groups_per_iter=groups_per_iter)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_w4_fused_row_kernels_match_the_unfused_ops():
    """The one-row kernel with RMSNorm(x + residual) before it (x + residual returned exactly),
    with SwiGLU after it (gate rows then up rows), and with SwiGLU before it, against
    kernels/gemv/reference on the dequantized weight (float32)."""
    from hearth_llm.kernels.gemv import reference
    from hearth_llm.kernels.quant import triton_w4, w4_layout

    weight = w4_layout.from_rows(random_w4_rows(24, 384, seed=7))
    dense = w4_layout.dequantize(weight)
    generator = torch.Generator().manual_seed(14)
    x, residual = torch.randn(1, 384, generator=generator), torch.randn(1, 384, generator=generator)
    norm_weight = torch.rand(384, generator=generator) + 0.5
    config = dict(block_n=8, groups_per_iter=2)

    def close(out, expected):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())

    out, summed = triton_w4.rms_norm_linear(x, residual, norm_weight, 1e-6, weight, **config)
    expected, expected_summed = reference.rms_norm_linear(x, residual, norm_weight, 1e-6, dense)
    close(out, expected)
    assert torch.equal(summed, expected_summed)
    act, summed = triton_w4.rms_norm_linear_silu_and_mul(x, residual, norm_weight, 1e-6, weight, **config)
    close(act, reference.rms_norm_linear_silu_and_mul(x, residual, norm_weight, 1e-6, dense)[0])
    assert act.shape == (1, 12) and torch.equal(summed, expected_summed)
    gate_up = torch.randn(1, 768, generator=generator)
    close(triton_w4.silu_and_mul_linear(gate_up, weight, **config), reference.silu_and_mul_linear(gate_up, dense))


def test_w4_dequantize_kernel_is_exact():
    from hearth_llm.kernels.quant import triton_w4, w4_layout

    weight = w4_layout.from_rows(random_w4_rows(40, 256, seed=4))
    assert torch.equal(triton_w4.dequantize(weight, torch.float32), w4_layout.dequantize(weight))


def test_w4_linear_refuses_x_of_the_wrong_width():
    from hearth_llm.kernels.quant import triton_w4, w4_layout

    weight = w4_layout.from_rows(random_w4_rows(8, 256, seed=5))
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        triton_w4.w4_linear(torch.randn(1, 128), weight)


def test_repacked_awq_layers_run_token_equal_to_hf(quantized_dirs, monkeypatch):
    """The CUDA path on the CPU: layers repacked into W4Weight after loading (REPACK_DEVICE_TYPES)
    and multiplied by triton_w4 in the interpreter, token-equal to HF on the dequantized model."""
    from hearth_llm.engine.models.quant import awq_gptq
    from hearth_llm.kernels import register_linear_routine
    from hearth_llm.kernels.quant import triton_w4, w4_layout

    monkeypatch.setattr(awq_gptq, "REPACK_DEVICE_TYPES", frozenset({"cpu"}))
    register_linear_routine(w4_layout.W4Weight, "cpu", triton_w4.w4_linear)
    try:
        prompts = random_prompts(2, [5, 1], seed=44)
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        with LLM(str(quantized_dirs["awq"]), dtype="float32", device="cpu", show_progress=False) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            layers = [layer for name, layer in linear_layers(llm.engine.runner.model) if name.startswith("layers.")]
            resident = sum(layer.method.resident_bytes(layer) for layer in layers)
    finally:  # back to what any device gets
        register_linear_routine(w4_layout.W4Weight, "cpu", w4_layout.reference_linear)
    assert all(awq_gptq.W4G128LinearMethod.w4_weight(layer) is not None for layer in layers)
    assert resident == sum(layer.output_size * layer.input_size for layer in layers) // GROUP * 68
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(quantized_dirs["dense"], prompt, 3)
