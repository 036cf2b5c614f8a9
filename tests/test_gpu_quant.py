"""On CUDA: the quantized kernels and methods of issue 16 against their torch references at real
layer sizes, and tiny models run quantized against the same models dense. Skipped without a GPU
(the CPU runs the same kernels under TRITON_INTERPRET in test_quant_gguf.py / test_quant_fp8.py)."""
from __future__ import annotations

import pytest
import torch

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.models.linear import linear_layers
from hearth_llm.engine.models.quant import Fp8LinearMethod, GGUFBlockLinearMethod
from hearth_llm.kernels.quant import BLOCK_FORMATS, fp8, gguf_reference

from conftest import TINY_CONFIGS, random_prompts
from model_equality import save_tiny_model
from test_quant_awq_gptq import quantized_dirs  # noqa: F401  (fixtures, used by name)
from test_quant_gguf import all_types_gguf, random_blocks  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TYPES = sorted(BLOCK_FORMATS)


CASES = [(quant_type, torch.bfloat16) for quant_type in TYPES] + [("Q4_K", torch.float32), ("Q6_K", torch.float32)]


@pytest.mark.parametrize("quant_type, dtype", CASES)
@pytest.mark.parametrize("num_rows", [1, 3, 300])  # the GEMV kernel, and the GEMM
def test_triton_gguf_kernel_matches_the_reference_on_gpu(quant_type, num_rows, dtype):
    from hearth_llm.kernels.quant import gguf_triton

    data = random_blocks(quant_type, 1000, 2048, seed=num_rows).cuda()
    x = torch.randn(num_rows, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    bias = torch.randn(1000, device="cuda")
    expected = gguf_reference.gguf_linear(x, data, quant_type, bias)  # float32, exact weights
    out = gguf_triton.gguf_linear(x.to(dtype), data, quant_type, bias.to(dtype))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def _greedy(path, dtype, **kwargs):
    prompts = random_prompts(4, [5, 17, 1, 40], seed=21)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), dtype=dtype, device="cuda", show_progress=False, **kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], list(linear_layers(llm.engine.runner.model))


def test_gguf_blocks_on_gpu_give_the_dense_tokens(all_types_gguf):  # noqa: F811
    path, linear_bytes = all_types_gguf
    blocks, layers = _greedy(path, "float32", quantization="gguf")
    dense, _ = _greedy(path, "float32")
    decoder = [layer for name, layer in layers if name.startswith("layers.")]
    assert all(isinstance(layer.method, GGUFBlockLinearMethod) for layer in decoder)
    assert sum(layer.method.resident_bytes(layer) for layer in decoder) == linear_bytes
    assert blocks == dense


@pytest.mark.parametrize("num_rows", [1, 16, 300])
def test_fp8_scaled_mm_matches_the_reference_on_gpu(num_rows):
    if not fp8.has_fp8_gemm(torch.device("cuda")):
        pytest.skip("this GPU has no FP8 GEMMs")
    generator = torch.Generator("cuda").manual_seed(1)
    weight_fp8, weight_scale = fp8.quantize_rows(torch.randn(4096, 2048, device="cuda", generator=generator))
    x = torch.randn(num_rows, 2048, device="cuda", generator=generator).bfloat16()
    expected = fp8.fp8_linear_reference(x.float(), weight_fp8, weight_scale)
    out = fp8.fp8_linear(x, weight_fp8, weight_scale)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 300])  # the GEMV up to GEMV_MAX_ROWS, then _scaled_mm
def test_triton_fp8_linear_matches_the_reference_on_gpu(num_rows):
    if not fp8.has_fp8_gemm(torch.device("cuda")):
        pytest.skip("this GPU has no FP8 GEMMs")
    from hearth_llm.kernels.quant import triton_fp8

    generator = torch.Generator("cuda").manual_seed(2)
    weight_fp8, weight_scale = fp8.quantize_rows(torch.randn(4096, 2048, device="cuda", generator=generator))
    x = torch.randn(num_rows, 2048, device="cuda", generator=generator).bfloat16()
    codes, scales = triton_fp8.quantize_rows(x)
    expected_codes, expected_scales = fp8.quantize_rows(x)
    torch.testing.assert_close(scales, expected_scales, rtol=2e-7, atol=0)
    # Our codes are exactly what the kernel says it computes, redone on the CPU in IEEE float32: x times
    # the rounded reciprocal of the scale (QUANTIZE_RECIP), else x / scale, then e4m3 to nearest even.
    x_cpu, scales_cpu = x.float().cpu(), scales.cpu()
    quotients = (x_cpu * (torch.ones_like(scales_cpu) / scales_cpu)[:, None] if triton_fp8.QUANTIZE_RECIP
                 else x_cpu / scales_cpu[:, None])
    ours = quotients.clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
    assert torch.equal(codes.cpu().view(torch.uint8), ours.view(torch.uint8))
    # torch's reference divides. The two differ only where the quotient is an e4m3 rounding tie (common
    # for bf16 x: x * 448 / amax often has 5 significant bits), there by one e4m3 step.
    different = codes.view(torch.uint8) != expected_codes.view(torch.uint8)
    ours_f, torch_f = codes.float()[different].double(), expected_codes.float()[different].double()
    assert ((ours_f - torch_f).abs() <= torch_f.abs() * 2**-3 + 2**-9).all()
    exact = (x.double() / scales.double()[:, None])[different]
    assert ((exact - (ours_f + torch_f) / 2).abs() <= exact.abs() * 2**-21).all()  # a tie, to float32 rounding
    bias = torch.randn(4096, device="cuda", generator=generator).bfloat16()
    expected = fp8.fp8_linear_reference(x.float(), weight_fp8, weight_scale, bias.float())
    out = triton_fp8.fp8_linear(x, weight_fp8, weight_scale, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("shape, split_k", [((4096, 4096), 2), ((1008, 14336), 4), ((28672, 4096), 1)])
def test_one_row_fp8_gemv_and_its_fused_prologues_match_the_unfused_ops_on_gpu(shape, split_k):
    """The bs1 GEMV against the exact product of the quantizer's codes (weights with subnormal e4m3
    codes among them), twice (split-K's buffers must come back clean); RMSNorm(x + residual) and
    SwiGLU fused in against that op's kernel followed by the plain one-row GEMV."""
    if not fp8.has_fp8_gemm(torch.device("cuda")):
        pytest.skip("this GPU has no FP8 GEMMs")
    from hearth_llm import kernels
    from hearth_llm.kernels.quant import triton_fp8

    n, k = shape
    generator = torch.Generator("cuda").manual_seed(n)
    weight = torch.randn(n, k, device="cuda", generator=generator) * 0.02
    weight[:, :64] *= 1e-4
    weight_fp8, weight_scale = fp8.quantize_rows(weight)
    x = torch.randn(1, k, device="cuda", generator=generator).bfloat16()
    codes, scale = triton_fp8.quantize_rows(x)
    exact = (codes.float() @ weight_fp8.float().t()) * scale[:, None] * weight_scale[None, :]
    launch = triton_fp8.RowLaunch(64, 512, 4, 3, split_k)
    for _ in range(2):
        out, _ = triton_fp8.row_gemv(x, weight_fp8, weight_scale, launch=launch)
        torch.testing.assert_close(out.float(), exact, rtol=1e-2, atol=1e-2 * exact.abs().max().item())
    residual = torch.randn_like(x)
    norm_weight = torch.rand(k, device="cuda", generator=generator).bfloat16() + 0.5
    normed, summed = kernels.rms_norm(x, norm_weight, 1e-5, residual)
    expected, _ = triton_fp8.row_gemv(normed, weight_fp8, weight_scale, launch=launch)
    out, fused_summed = triton_fp8.row_gemv(x, weight_fp8, weight_scale, prologue=triton_fp8.RMS_NORM,
                                            residual=residual, norm_weight=norm_weight, eps=1e-5, launch=launch)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    assert torch.equal(fused_summed, summed)
    gate_up = torch.randn(1, 2 * k, device="cuda", generator=generator).bfloat16()
    expected, _ = triton_fp8.row_gemv(kernels.silu_and_mul(gate_up), weight_fp8, weight_scale, launch=launch)
    out, _ = triton_fp8.row_gemv(gate_up, weight_fp8, weight_scale, prologue=triton_fp8.SILU_AND_MUL, launch=launch)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_fp8_engine_on_gpu_stays_close_to_bf16(tmp_path):
    if not fp8.has_fp8_gemm(torch.device("cuda")):
        pytest.skip("this GPU has no FP8 GEMMs")
    path = save_tiny_model(TINY_CONFIGS["llama"](), tmp_path / "llama")
    quantized, layers = _greedy(path, "bfloat16", quantization="fp8")
    dense, _ = _greedy(path, "bfloat16")
    assert all(isinstance(layer.method, Fp8LinearMethod) for _, layer in layers)
    first_tokens_agree = [q[0] == d[0] for q, d in zip(quantized, dense)]
    assert sum(first_tokens_agree) >= 3, (quantized, dense)


def test_fp8_checkpoint_on_gpu_runs_like_quantizing_at_load(tmp_path):
    if not fp8.has_fp8_gemm(torch.device("cuda")):
        pytest.skip("this GPU has no FP8 GEMMs")
    from test_quant_fp8 import write_fp8_checkpoint

    path = save_tiny_model(TINY_CONFIGS["llama"](), tmp_path / "llama")
    stored, _ = _greedy(write_fp8_checkpoint(path, tmp_path / "fp8"), "float32")
    at_load, _ = _greedy(path, "float32", quantization="fp8")
    assert stored == at_load


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoints_on_gpu_give_the_dequantized_models_tokens(method, quantized_dirs):  # noqa: F811
    quantized, layers = _greedy(quantized_dirs[method], "float32")
    dense, _ = _greedy(quantized_dirs["dense"], "float32")
    assert all(isinstance(layer.method, GGUFBlockLinearMethod) for name, layer in layers if name.startswith("layers."))
    assert quantized == dense
