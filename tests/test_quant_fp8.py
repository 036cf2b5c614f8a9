"""FP8 W8A8 (``quantization="fp8"``): the row quantizer's error bound, ``torch._scaled_mm`` with
row-wise scales against the float32 reference (the CPU emulates it; the H200 runs
tests/test_gpu_quant.py), and a tiny Llama quantized at load: FP8 buffers only, the logits close to
the dense model's, refusals by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.models.linear import linear_layers
from hearth_llm.engine.models.quant import Fp8LinearMethod
from hearth_llm.kernels.quant import fp8

from conftest import TINY_CONFIGS, random_prompts
from model_equality import save_tiny_model


def test_quantize_rows_maps_each_rows_largest_magnitude_to_448_within_e4m3_rounding():
    weight = torch.randn(24, 80, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 24)[:, None]
    weight[5] = 0  # a zero row stays zero
    quantized, scale = fp8.quantize_rows(weight)
    assert quantized.dtype == torch.float8_e4m3fn and scale.shape == (24,)
    assert quantized.float().abs().amax(dim=1)[torch.arange(24) != 5].eq(448).all()
    error = (quantized.float() * scale[:, None] - weight).abs()
    # e4m3: 3 mantissa bits (half a step: 2^-4 relative), subnormal steps of 2^-9 of the scale.
    assert (error <= weight.abs() * 2**-4 + scale[:, None] * 2**-9 + 1e-12).all()
    assert quantized[5].float().eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_matches_the_float32_reference(dtype):
    generator = torch.Generator().manual_seed(1)
    weight_fp8, weight_scale = fp8.quantize_rows(torch.randn(48, 64, generator=generator))
    x, bias = torch.randn(5, 64, generator=generator).to(dtype), torch.randn(48, generator=generator).to(dtype)
    expected = fp8.fp8_linear_reference(x, weight_fp8, weight_scale, bias)
    out = fp8.fp8_linear(x, weight_fp8, weight_scale, bias)
    assert out.dtype == dtype
    # _scaled_mm rounds its output to bf16 (row-wise scaling has no fp32 output).
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("num_rows", [1, 3, 8])
def test_triton_fp8_gemv_multiplies_the_codes_like_the_float32_reference(num_rows):
    """The decode GEMV of triton_fp8 (TRITON_INTERPRET here; its quantizer is checked on the GPU,
    the interpreter's float32 -> e4m3 cast does not round to nearest even)."""
    from hearth_llm.kernels.quant import triton_fp8

    generator = torch.Generator().manual_seed(3)
    weight_fp8, weight_scale = fp8.quantize_rows(torch.randn(40, 96, generator=generator))
    x_fp8, x_scale = fp8.quantize_rows(torch.randn(num_rows, 96, generator=generator))
    bias = torch.randn(40, generator=generator)
    out = torch.empty(num_rows, 40)
    m_pad = 1 << (num_rows - 1).bit_length()
    triton_fp8._fp8_gemv_kernel[(3,)](x_fp8, x_scale, weight_fp8, weight_scale, bias, out, num_rows, 40, 96,
                                      x_fp8.stride(0), weight_fp8.stride(0), out.stride(0), HAS_BIAS=True,
                                      M_PAD=m_pad, BLOCK_N=16, BLOCK_K=64)
    expected = (x_fp8.float() @ weight_fp8.float().t()) * x_scale[:, None] * weight_scale[None, :] + bias
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_rows, recip, split_k", [(1, True, 2), (5, False, 1), (3, True, 3)])
def test_tensor_core_fp8_gemv_quantizes_and_multiplies_like_the_reference(num_rows, recip, split_k):
    """The GEMV that takes high-precision x and quantizes it itself (TRITON_INTERPRET here). x is
    made of e4m3 codes times a per-row scale, so the right quantizer gives back exactly those codes
    and that scale (the interpreter's own float32 -> e4m3 cast does not round to nearest even, so
    inputs between codes would test the interpreter). Split-K runs with K = 96 in 32-column tiles:
    three parts of one tile each; the last part to finish reduces."""
    from hearth_llm.kernels.quant import triton_fp8

    generator = torch.Generator().manual_seed(5 + num_rows)
    weight_fp8, weight_scale = fp8.quantize_rows(torch.randn(40, 96, generator=generator))
    codes, _ = fp8.quantize_rows(torch.randn(num_rows, 96, generator=generator))
    # Each row's largest code is 448, so a power-of-two scale per row is exactly what the kernel
    # derives (amax / 448), and its reciprocal is exact too.
    scale = 2.0 ** -torch.arange(3, 3 + num_rows, dtype=torch.float32)
    x = codes.float() * scale[:, None]
    bias = torch.randn(40, generator=generator)
    expected = (codes.float() @ weight_fp8.float().t()) * scale[:, None] * weight_scale[None, :] + bias
    for _ in range(2):  # split-K's workspace and counters must be clean again for the second call
        out = triton_fp8.dot_gemv(x, weight_fp8, weight_scale, bias, block_n=16, block_k=32, num_warps=1,
                                  recip=recip, split_k=split_k)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("num_rows, split_k, block_k", [(5, 1, 32), (17, 3, 32), (9, 2, 64)])
def test_fp8_codes_gemm_multiplies_the_codes_like_the_float32_reference(num_rows, split_k, block_k):
    """The swapped-operand GEMM of pre-quantized rows (TRITON_INTERPRET here), unsplit, split in
    whole tiles, and split with a cut last tile; twice each, the split buffers must come back clean."""
    from hearth_llm.kernels.quant import triton_fp8

    generator = torch.Generator().manual_seed(20 + num_rows)
    weight_fp8, weight_scale = fp8.quantize_rows(torch.randn(40, 96, generator=generator))
    x_fp8, x_scale = fp8.quantize_rows(torch.randn(num_rows, 96, generator=generator))
    bias = torch.randn(40, generator=generator)
    expected = (x_fp8.float() @ weight_fp8.float().t()) * x_scale[:, None] * weight_scale[None, :] + bias
    for _ in range(2):
        out = triton_fp8.codes_gemm(x_fp8, x_scale, weight_fp8, weight_scale, bias, torch.float32, block_n=16,
                                    block_k=block_k, num_warps=1, num_stages=2, split_k=split_k)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


# --- the one-row GEMV of batch-size-1 decode (triton_fp8.row_gemv, TRITON_INTERPRET here) ----------

def _codes_times_power_of_two(num_columns: int, seed: int, scale: float = 2.0 ** -4):
    """A row made of e4m3 codes (largest 448) times a power of two: the kernel's quantizer must give
    back exactly these codes and this scale, whatever the interpreter's rounding of other values."""
    codes, _ = fp8.quantize_rows(torch.randn(1, num_columns, generator=torch.Generator().manual_seed(seed)))
    return codes, codes.float() * scale


@pytest.mark.parametrize("split_k, block_k, prefetch", [(1, 32, True), (3, 32, True), (1, 64, False), (2, 64, True)])
def test_one_row_fp8_gemv_quantizes_and_multiplies_like_the_reference(split_k, block_k, prefetch):
    """K = 96: in 32-column tiles every part is whole tiles (unmasked weight loads); in 64-column
    tiles the last tile is cut (masked), and with two parts the second holds only that cut tile."""
    from hearth_llm.kernels.quant import triton_fp8

    generator = torch.Generator().manual_seed(11)
    weight_fp8, weight_scale = fp8.quantize_rows(torch.randn(40, 96, generator=generator))
    codes, x = _codes_times_power_of_two(96, seed=12)
    bias = torch.randn(40, generator=generator)
    expected = (codes.float() @ weight_fp8.float().t()) * 2.0 ** -4 * weight_scale[None, :] + bias
    launch = triton_fp8.RowLaunch(block_n=16, block_k=block_k, num_warps=1, num_stages=2, split_k=split_k,
                                  prefetch=prefetch)
    for _ in range(2):  # split-K's workspace and counters must be clean again for the second call
        out, summed = triton_fp8.row_gemv(x, weight_fp8, weight_scale, bias, launch=launch)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        assert summed is x


def test_one_row_fp8_gemv_with_rms_norm_is_the_gemv_of_the_normed_row_and_returns_the_sum():
    from hearth_llm.kernels.norm import reference as norm_reference
    from hearth_llm.kernels.quant import triton_fp8

    generator = torch.Generator().manual_seed(13)
    weight_fp8, weight_scale = fp8.quantize_rows(torch.randn(40, 96, generator=generator))
    x, residual = torch.randn(1, 96, generator=generator), torch.randn(1, 96, generator=generator)
    norm_weight = torch.rand(96, generator=generator) + 0.5
    normed, summed = norm_reference.rms_norm(x, norm_weight, 1e-6, residual)
    launch = triton_fp8.RowLaunch(block_n=16, block_k=32, num_warps=1, num_stages=2, split_k=3)
    expected, _ = triton_fp8.row_gemv(normed, weight_fp8, weight_scale, launch=launch)
    out, fused_summed = triton_fp8.row_gemv(x, weight_fp8, weight_scale, prologue=triton_fp8.RMS_NORM,
                                            residual=residual, norm_weight=norm_weight, eps=1e-6, launch=launch)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(fused_summed, summed, rtol=0, atol=0)


def test_one_row_fp8_gemv_with_silu_and_mul_is_the_gemv_of_the_activation():
    from hearth_llm.kernels.activation import reference as activation_reference
    from hearth_llm.kernels.quant import triton_fp8

    generator = torch.Generator().manual_seed(14)
    weight_fp8, weight_scale = fp8.quantize_rows(torch.randn(40, 96, generator=generator))
    gate_up = torch.randn(1, 192, generator=generator)
    launch = triton_fp8.RowLaunch(block_n=16, block_k=32, num_warps=1, num_stages=2, split_k=2)
    expected, _ = triton_fp8.row_gemv(activation_reference.silu_and_mul(gate_up), weight_fp8, weight_scale,
                                      launch=launch)
    out, _ = triton_fp8.row_gemv(gate_up, weight_fp8, weight_scale, prologue=triton_fp8.SILU_AND_MUL, launch=launch)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_one_row_fp8_gemv_refuses_a_row_of_the_wrong_width_by_name():
    from hearth_llm.kernels.quant import triton_fp8

    weight_fp8, weight_scale = fp8.quantize_rows(torch.randn(40, 96))
    with pytest.raises(ValueError, match=r"x must be \[1, 192\]"):
        triton_fp8.row_gemv(torch.randn(1, 96), weight_fp8, weight_scale, prologue=triton_fp8.SILU_AND_MUL)
    with pytest.raises(ValueError, match="norm_weight must be"):
        triton_fp8.row_gemv(torch.randn(1, 96), weight_fp8, weight_scale, prologue=triton_fp8.RMS_NORM)
    with pytest.raises(ValueError, match="one row"):
        triton_fp8.row_gemv(torch.randn(2, 96), weight_fp8, weight_scale)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_model(TINY_CONFIGS["llama"](), tmp_path_factory.mktemp("fp8") / "llama")


def _run(path, **kwargs):
    prompts = random_prompts(6, [7, 19, 3], seed=31)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    with LLM(str(path), dtype="float32", device="cpu", show_progress=False, **kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, list(linear_layers(llm.engine.runner.model))


def test_fp8_quantizes_every_decoder_linear_at_load_and_stays_close_to_dense(tiny_llama):
    quantized, layers = _run(tiny_llama, quantization="fp8")
    dense, _ = _run(tiny_llama)
    for name, layer in layers:
        assert isinstance(layer.method, Fp8LinearMethod), name
        assert layer.weight_fp8.dtype == torch.float8_e4m3fn and not hasattr(layer, "weight")
        assert layer.weight_scale.shape == (layer.output_size,)
    agree = [q.outputs[0].token_ids == d.outputs[0].token_ids for q, d in zip(quantized, dense)]
    assert sum(agree) >= 5, agree  # fp8 noise may flip a near tie, not most choices
    for q, d in zip(quantized, dense):
        token = d.outputs[0].token_ids[0]
        top = q.outputs[0].logprobs[0]
        if token in top:  # the dense choice is in FP8's top 5; its log-probability moved little
            assert abs(top[token].logprob - d.outputs[0].logprobs[0][token].logprob) < 0.3


def test_fp8_is_refused_for_a_gguf_file():
    with pytest.raises(ValueError, match="quantization='fp8' quantizes a 16/32-bit checkpoint"):
        LLM("default", device="cpu", quantization="fp8", show_progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_is_refused_on_a_gpu_without_fp8():
    if fp8.has_fp8_gemm(torch.device("cuda")):
        pytest.skip("this GPU has FP8 GEMMs")
    with pytest.raises(ValueError, match="compute capability 8.9"):
        LLM("default", device="cuda", quantization="fp8", show_progress=False)


# --- compressed-tensors FP8 checkpoints (llm-compressor's FP8_DYNAMIC layout), loaded as stored ----

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def compressed_tensors_config(weight_strategy: str = "channel", activations: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": weight_strategy, "symmetric": True,
                            "dynamic": False, "group_size": None, "block_structure": None},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                      "symmetric": True, **(activations or {})}}}}


def write_fp8_checkpoint(source, target, strategy: str = "channel"):
    """``source``'s decoder linears as e4m3 weights with their scales (per row, or one per tensor)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in LINEARS]:
        weight = tensors[name]
        if strategy == "channel":
            quantized, scale = fp8.quantize_rows(weight)
            tensors[name + "_scale"] = scale[:, None].contiguous()
        else:
            quantized, scale = fp8.quantize_rows(weight.reshape(1, -1))
            quantized = quantized.reshape(weight.shape)
            tensors[name + "_scale"] = scale.contiguous()  # [1]
        tensors[name] = quantized.contiguous()
    save_file(tensors, target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = compressed_tensors_config(strategy)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_per_channel_fp8_checkpoint_runs_as_stored_like_quantizing_at_load(tiny_llama, tmp_path):
    from hearth_llm.engine.models.quant import Fp8CheckpointLinearMethod

    checkpoint = write_fp8_checkpoint(tiny_llama, tmp_path / "fp8-channel")
    stored, layers = _run(checkpoint)
    at_load, _ = _run(tiny_llama, quantization="fp8")
    assert all(type(layer.method) is Fp8CheckpointLinearMethod for _, layer in layers)
    for a, b in zip(stored, at_load):  # the same e4m3 values and scales: the same numbers
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs[0] == b.outputs[0].logprobs[0]


def test_a_per_tensor_fp8_checkpoint_loads_each_shards_scale(tiny_llama, tmp_path):
    checkpoint = write_fp8_checkpoint(tiny_llama, tmp_path / "fp8-tensor", strategy="tensor")
    stored, layers = _run(checkpoint)
    dense, _ = _run(tiny_llama)
    qkv = dict(layers)["layers.0.self_attn.qkv_proj"]
    assert len(set(qkv.weight_scale.tolist())) == 3  # q, k and v: one scale each, repeated on their rows
    agree = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(stored, dense)]
    assert sum(agree) >= 4, agree


@pytest.mark.parametrize("change, field", [
    (dict(activations=dict(dynamic=False, strategy="tensor")), "input_activations.strategy='tensor'"),
    (dict(weight_strategy="block"), "weights.strategy='block'"),
])
def test_fp8_checkpoint_fields_we_do_not_run_are_refused_by_name(tiny_llama, tmp_path, change, field):
    import json

    path = write_fp8_checkpoint(tiny_llama, tmp_path / "fp8")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = compressed_tensors_config(**change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"quantization_config.config_groups.group_0.{field} is not supported"):
        LLM(str(path), device="cpu", show_progress=False)
