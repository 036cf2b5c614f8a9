"""Batches on AMX tiles decoded from GGUF blocks (``kernels/quant/gguf_cpu_amx.c``): the products of the
exactly dequantized weights rounded to bf16 (what a bf16 dense copy holds) with float32 sums, for any row
count and every block type; and GGUF layers whose batches run there keep no dense copy."""
from __future__ import annotations

import pytest
import torch

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.models import gguf_linear_method
from hearth_llm.engine.models.linear import linear_layers
from hearth_llm.kernels.quant import BLOCK_FORMATS, gguf_cpu_native, gguf_reference

from test_quant_gguf import random_blocks

pytestmark = pytest.mark.skipif(not gguf_cpu_native.available() or not gguf_cpu_native.has_amx(),
                                reason="no AMX-BF16 here (or no C compiler): batches keep their dense copy")
TYPES = sorted(BLOCK_FORMATS)


def _bf16_weight_product(x: torch.Tensor, data: torch.Tensor, quant_type: str) -> torch.Tensor:
    weight = gguf_reference.dequantize(data, quant_type).bfloat16()
    return x.double() @ weight.double().T


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("num_rows", [9, 32, 45, 100])
def test_amx_batches_multiply_the_exact_weights_rounded_to_bf16(quant_type, num_rows):
    num_columns = 4 * BLOCK_FORMATS[quant_type].block_size
    # 208 output rows: more than one tile of rows for K = 1024, the last one not a multiple of 32
    data = random_blocks(quant_type, 208 if num_columns >= 1024 else 48, num_columns, seed=num_rows)
    x = torch.randn(num_rows, num_columns, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = gguf_cpu_native.amx_linear(x, data, quant_type, bf16_out=False)
    expected = _bf16_weight_product(x, data, quant_type)
    # bf16 x bf16 products are exact in float32: only the float32 summation order differs
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=4e-6 * expected.abs().max().item())


def test_amx_bf16_out_is_the_float32_sums_rounded_to_nearest_even():
    data = random_blocks("Q4_K", 64, 512, seed=2)
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    sums = gguf_cpu_native.amx_linear(x, data, "Q4_K", bf16_out=False)
    assert torch.equal(gguf_cpu_native.amx_linear(x, data, "Q4_K"), sums.bfloat16())


def test_amx_rows_get_the_same_bits_in_any_batch_and_thread_count():
    data = random_blocks("Q8_0", 320, 2048, seed=3)  # 320 rows: 5 tiles of 64 rows at K = 2048
    x = torch.randn(40, 2048, generator=torch.Generator().manual_seed(3)).bfloat16()
    whole = gguf_cpu_native.amx_linear(x, data, "Q8_0", bf16_out=False, num_threads=1)
    assert torch.equal(gguf_cpu_native.amx_linear(x, data, "Q8_0", bf16_out=False, num_threads=2), whole)
    assert torch.equal(gguf_cpu_native.amx_linear(x[:9], data, "Q8_0", bf16_out=False), whole[:9])


def test_amx_routine_writes_a_run_into_its_columns_of_a_wider_output():
    first, second = random_blocks("Q4_K", 32, 256, seed=4), random_blocks("Q6_K", 16, 256, seed=5)
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    fused = gguf_linear_method.amx_batches([("Q4_K", first), ("Q6_K", second)], bias=None)(x)
    expected = torch.cat([gguf_cpu_native.amx_linear(x, first, "Q4_K"), gguf_cpu_native.amx_linear(x, second, "Q6_K")], -1)
    assert torch.equal(fused, expected)


def test_amx_refuses_rows_not_in_sixteens():
    with pytest.raises(ValueError, match="multiples of 16"):
        gguf_cpu_native.amx_routine(random_blocks("Q8_0", 24, 64, seed=6), "Q8_0")


def test_bundled_smollm2_keeps_no_dense_copy_and_answers_as_with_it(monkeypatch):
    """The Q4_1 layers' prefill on AMX tiles of the blocks gives the greedy tokens of the dense bf16 copy
    (the same products; the int4 layout's bf16 scales changed this model's answers)."""
    from hearth_llm.engine.loader import default_model_path

    prompt = [(37 * i) % 40000 + 100 for i in range(120)]  # 120 tokens: a prefill batch, then decode steps
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for dense_copy in (False, True):
        monkeypatch.setattr(gguf_linear_method, "DENSE_COPY_WITH_AMX", dense_copy)
        with LLM(default_model_path(), dtype="bfloat16", device="cpu", show_progress=False) as llm:
            layers = [layer for _, layer in linear_layers(llm.engine.runner.model)]
            assert all((layer.cpu_weight is None) != dense_copy for layer in layers)
            tokens[dense_copy] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[False] == tokens[True]
