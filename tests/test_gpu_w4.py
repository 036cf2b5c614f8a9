"""On CUDA: the w4a16 kernels of kernels/quant/triton_w4.py against the dequantized reference at
Llama-3-8B layer sizes, inside CUDA graphs, and an AWQ model whose decode steps replay graphs.
Skipped without a GPU (the CPU runs the same kernels under TRITON_INTERPRET in
test_quant_awq_gptq.py)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.models.linear import linear_layers
from hearth_llm.engine.models.quant.awq_gptq import W4G128LinearMethod
from hearth_llm.kernels.quant import triton_w4, w4_layout

from conftest import random_prompts
from test_quant_awq_gptq import quantized_dirs, random_w4_rows  # noqa: F401  (fixtures, used by name)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@functools.lru_cache(maxsize=4)
def _weight(num_rows: int, num_columns: int, seed: int = 0) -> w4_layout.W4Weight:
    return w4_layout.from_rows(random_w4_rows(num_rows, num_columns, seed).cuda())


def _close(out: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-2) -> None:
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (1000, 384)])
@pytest.mark.parametrize("num_rows", [1, 2, 4, 8, 16, 40])
def test_w4_linear_matches_the_dequantized_reference(shape, num_rows):
    """The default path of each row count (GEMV, tensor-core GEMV, dequantize + cuBLAS), bf16 x, a
    bias, called twice (split-K leaves its workspace zeroed for the next call)."""
    weight = _weight(*shape)
    x = torch.randn(num_rows, shape[1], device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(shape[0], device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x.float(), w4_layout.dequantize(weight), bias.float())
    for _ in range(2):
        _close(triton_w4.w4_linear(x, weight, bias), expected)


@pytest.mark.parametrize("kernel, options", [("gemv", {}), ("gemv", {"prefetch": False}), ("gemv", {"groups_per_iter": 1}),
                                             ("dot_gemv", {}), ("dot_gemv", {"asm_decode": True}), ("row_gemv", {}),
                                             ("row_gemv", {"pdl": False})])
@pytest.mark.parametrize("split_k", [1, 3, 8])
def test_w4_gemvs_match_the_reference_with_any_split(kernel, options, split_k):
    """Each GEMV (the tensor-core one with either decode) at 1 and 5 rows, split in 1, 3 or 8 parts."""
    weight = _weight(4096, 4096)
    for num_rows in (1, 5) if kernel == "dot_gemv" else (1,):
        x = torch.randn(num_rows, 4096, device="cuda", dtype=torch.bfloat16)
        expected = F.linear(x.float(), w4_layout.dequantize(weight))
        _close(getattr(triton_w4, kernel)(x, weight, split_k=split_k, **options), expected)


def test_w4_fused_row_kernels_match_the_unfused_ops_on_gpu():
    """bf16, 8B widths: RMSNorm(x + residual) before the one-row kernel (x + residual exact),
    RMSNorm with SwiGLU after it, SwiGLU before it, against kernels/gemv/reference on the
    dequantized weight (the fused norm is one pass: not rounded to bf16 before the matmul)."""
    from hearth_llm.kernels.gemv import reference

    x, residual = (torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    norm_weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    weight = _weight(6144, 4096)
    dense = w4_layout.dequantize(weight)
    out, summed = triton_w4.rms_norm_linear(x, residual, norm_weight, 1e-5, weight)
    expected, expected_summed = reference.rms_norm_linear(x.float(), residual.float(), norm_weight.float(), 1e-5, dense)
    _close(out, expected)
    assert torch.equal(summed, x + residual)
    act, _ = triton_w4.rms_norm_linear_silu_and_mul(x, residual, norm_weight, 1e-5, weight)
    _close(act, reference.rms_norm_linear_silu_and_mul(x.float(), residual.float(), norm_weight.float(), 1e-5, dense)[0],
           tolerance=2e-2)
    down = _weight(4096, 14336)
    gate_up = torch.randn(1, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    _close(triton_w4.silu_and_mul_linear(gate_up, down),
           reference.silu_and_mul_linear(gate_up, w4_layout.dequantize(down).bfloat16()).float())


def test_w4_float32_gemv_is_close_to_exact():
    weight = _weight(1000, 512, seed=1)
    x = torch.randn(1, 512, device="cuda")
    _close(triton_w4.w4_linear(x, weight), w4_layout.reference_linear(x, weight), tolerance=1e-5)


def test_w4_dequantize_kernel_is_exact_on_gpu():
    weight = _weight(1000, 1024, seed=2)
    assert torch.equal(triton_w4.dequantize(weight, torch.float32), w4_layout.dequantize(weight))


@pytest.mark.parametrize("num_rows", [1, 4])
def test_w4_linear_replays_in_a_cuda_graph(num_rows):
    """Captured after one eager call (which makes the split-K buffers), replays give the eager result."""
    weight = _weight(4096, 4096)
    x = torch.randn(num_rows, 4096, device="cuda", dtype=torch.bfloat16)
    eager = triton_w4.w4_linear(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_w4.w4_linear(x, weight)
    for _ in range(3):
        graph.replay()
    torch.testing.assert_close(captured, eager)


def test_awq_model_on_gpu_decodes_in_cuda_graphs_like_its_dequantized_model(quantized_dirs):  # noqa: F811
    """bf16: layers repacked into W4Weight, decode steps replayed from graphs, and the greedy tokens
    those of the dense dequantized model (first tokens equal on most prompts: the top-5 rule's
    spirit at this size)."""
    prompts = random_prompts(4, [7, 12, 3, 20], seed=45)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(quantized_dirs["awq"]), dtype="bfloat16", device="cuda", show_progress=False) as llm:
        quantized = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.engine.runner
        layers = [layer for name, layer in linear_layers(runner.model) if name.startswith("layers.")]
        num_replays = runner.decode_graphs.num_replays
    with LLM(str(quantized_dirs["dense"]), dtype="bfloat16", device="cuda", show_progress=False) as llm:
        dense = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(W4G128LinearMethod.w4_weight(layer) is not None for layer in layers)
    assert num_replays > 0
    assert sum(q[0] == d[0] for q, d in zip(quantized, dense)) >= 3, (quantized, dense)
