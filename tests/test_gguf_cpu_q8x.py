"""The int8-activation GGUF CPU kernels (``kernels/quant/gguf_cpu_q8x.py``, opt-in): x's quantizer bit-equal
to the torch reference, the plain-C path bit-equal to the torch reference of the same math, this build's
vector path (AVX-512 VNNI, AVX2 under ``HEARTH_LLM_KERNEL_CFLAGS=-mno-avx512f``) equal to it up to float32
summation order, each row's bits independent of the row count and thread count, and the result within
x's quantization error of gguf-py's dequantized weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from hearth_llm.kernels.quant import gguf_cpu_q8x

from test_quant_gguf import random_blocks

pytestmark = pytest.mark.skipif(not gguf_cpu_q8x.available(), reason="no C compiler: the int8-activation kernels "
                                "are not built")
TYPES = list(gguf_cpu_q8x.TYPES)


def _x(rows, columns, seed=3, dtype=torch.float32):
    x = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    x[-1, 40] = 50.0  # an outlier: its block's scale follows it
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_is_bit_equal_to_the_torch_reference(dtype):
    x = _x(5, 7 * 32, dtype=dtype)
    codes, scales, sums = gguf_cpu_q8x.quantize_rows(x)
    ref_codes, ref_scales, ref_sums = gguf_cpu_q8x.quantize_rows_reference(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales) and torch.equal(sums, ref_sums)
    assert codes.abs().max() == 127 and scales[0, 0] == 0 and torch.all(codes[0, :32] == 0)
    # the codes times their scale are x within half a step
    step = scales.repeat_interleave(32, dim=1)
    assert torch.all((codes.float() * step - x.float()).abs() <= step * 0.5 * (1 + 1e-5) + 1e-30)


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_c_path_is_bit_equal_to_the_torch_reference(quant_type, dtype):
    data = random_blocks(quant_type, 19, 5 * 32, seed=1)
    x = _x(8, 5 * 32, dtype=dtype)
    for rows in (1, 3, 8):
        out = gguf_cpu_q8x.gemv_scalar(x[:rows], data, quant_type)
        assert torch.equal(out.view(torch.int32), gguf_cpu_q8x.reference(x[:rows], data, quant_type).view(torch.int32))


def _kernel(kernel, data, quant_type):
    if kernel == "rows":
        return lambda x, num_threads=None, bf16_out=False: gguf_cpu_q8x.gemv(x, data, quant_type, num_threads, bf16_out)
    if not gguf_cpu_q8x.has_panels():
        pytest.skip("no AVX-512 VNNI or AVX2: the panel kernels are not in this build")
    panels = gguf_cpu_q8x.pack(data, quant_type)
    routines = {bf16_out: gguf_cpu_q8x.panel_gemv_routine(panels, quant_type, bf16_out) for bf16_out in (False, True)}

    def run(x, num_threads=None, bf16_out=False):
        previous = torch.get_num_threads()
        torch.set_num_threads(num_threads or previous)
        try:
            return routines[bf16_out](x.contiguous())
        finally:
            torch.set_num_threads(previous)

    return run


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("num_columns", [5 * 32, 8 * 32])  # an odd and an even block count
@pytest.mark.parametrize("kernel", ["rows", "panels"])
def test_vector_path_matches_the_reference_and_is_row_invariant(quant_type, num_columns, kernel):
    # 48 rows: uneven thread chunks for the row kernel, three panels of 16
    data = random_blocks(quant_type, 48, num_columns, seed=2)
    gemv = _kernel(kernel, data, quant_type)
    x = _x(8, num_columns)
    codes, dw, mw = gguf_cpu_q8x.block_codes(data, quant_type)
    q, d, sums = gguf_cpu_q8x.quantize_rows_reference(x)
    # the float32 block terms' magnitudes bound the summation-order difference
    terms = torch.einsum("nbj,mbj->mnb", codes.double(), q.reshape(8, -1, 32).double()).abs() \
        * (dw[None] * d[:, None]).double()
    if mw is not None:
        terms = terms + (mw[None] * sums[:, None]).double().abs()
    bound = terms.sum(-1) * 2e-6 + 1e-30
    full = gemv(x)
    assert ((full.double() - gguf_cpu_q8x.reference(x, data, quant_type).double()).abs() <= bound).all()
    for rows in range(1, 9):  # each row's bits whatever the rows beside it
        assert torch.equal(gemv(x[:rows]), full[:rows])
    assert torch.equal(gemv(x[5:6]), full[5:6])
    assert torch.equal(gemv(x, num_threads=2), gemv(x, num_threads=1))
    xb = x.bfloat16()
    assert torch.equal(gemv(xb, bf16_out=True), gemv(xb).bfloat16())


@pytest.mark.parametrize("quant_type", TYPES)
def test_result_is_within_the_quantization_error_of_gguf_py(quant_type):
    data = random_blocks(quant_type, 33, 6 * 32, seed=4)
    x = _x(4, 6 * 32, seed=5)
    weight = torch.from_numpy(np.ascontiguousarray(
        gguf_dequantize(data.numpy(), GGMLQuantizationType[quant_type]).reshape(33, -1).astype(np.float64)))
    exact = x.double() @ weight.T
    out = gguf_cpu_q8x.gemv(x, data, quant_type).double()
    _, scales, _ = gguf_cpu_q8x.quantize_rows(x)
    # |x - q d| <= d / 2 per value: the error is at most sum_k |w_nk| d_k / 2 (plus float32 slop)
    bound = weight.abs() @ (scales.double().repeat_interleave(32, dim=1) * 0.5).T
    assert ((out - exact).abs() <= bound.T * (1 + 1e-4) + 1e-6 * exact.abs()).all()
    assert (out - exact).abs().max() > 0  # int8 x: not the exact product
    assert (out - exact).abs().max() < 0.05 * exact.abs().max()


def test_panels_hold_the_same_bytes_rearranged():
    if not gguf_cpu_q8x.available():
        pytest.skip("not built")
    data = random_blocks("Q4_1", 32, 64, seed=6)
    panels = gguf_cpu_q8x.pack(data, "Q4_1")
    assert panels.shape == (2, 2 * 320)
    blocks = data.reshape(32, 2, 20)
    first = panels[0, :320]  # panel 0, block 0: 16 fp16 d, 16 fp16 m, then 4-byte groups of the codes
    assert torch.equal(first[:32].reshape(16, 2), blocks[:16, 0, :2])
    assert torch.equal(first[32:64].reshape(16, 2), blocks[:16, 0, 2:4])
    assert torch.equal(first[64:128].reshape(16, 4), blocks[:16, 0, 4:8])
    with pytest.raises(ValueError, match="multiples of 16"):
        gguf_cpu_q8x.pack(data[:8], "Q4_1")


def test_bad_arguments_raise_value_errors_naming_them():
    data = random_blocks("Q4_1", 4, 64, seed=1)
    with pytest.raises(ValueError, match="quant_type"):
        gguf_cpu_q8x.gemv(torch.zeros(1, 64), data, "Q4_K")
    with pytest.raises(ValueError, match="x must be"):
        gguf_cpu_q8x.gemv(torch.zeros(9, 64), data, "Q4_1")
    with pytest.raises(ValueError, match="x must be"):
        gguf_cpu_q8x.gemv(torch.zeros(1, 96), data, "Q4_1")


# ---- the engine option ------------------------------------------------------------------------------

def test_engine_option_is_validated():
    from hearth_llm.engine.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_int8_activations"):
        EngineConfig(model="default", cpu_int8_activations="yes")
    with pytest.raises(ValueError, match="cpu_int8_activations"):
        EngineConfig(model="default", device="cuda", cpu_int8_activations=True)
    with pytest.raises(ValueError, match="cpu_int8_activations"):
        EngineConfig(model="default", tensor_parallel_size=2, cpu_int8_activations=True)
    assert EngineConfig(model="default", sleep_level=2, cpu_int8_activations=True).sleep_level == 2  # re-applied on wake
    assert EngineConfig(model="default").cpu_int8_activations is False


def test_engine_option_without_the_panel_kernels_raises_a_value_error(monkeypatch):
    from hearth_llm.engine import LLM

    monkeypatch.setattr(gguf_cpu_q8x, "has_panels", lambda: False)
    with pytest.raises(ValueError, match="cpu_int8_activations=True needs"):
        LLM("default", show_progress=False, num_threads=1, cpu_int8_activations=True)


def test_engine_option_refuses_a_model_without_gguf_blocks(tmp_path):
    from hearth_llm.engine.config import EngineConfig

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="cpu_int8_activations"):
        EngineConfig(model=str(tmp_path), cpu_int8_activations=True)


def test_default_model_runs_int8_steps_and_speculative_greedy_equals_plain_greedy():
    from hearth_llm.engine import LLM, SamplingParams
    from hearth_llm.engine.models.cpu_weights import CpuBlockLogitsHead

    exact = LLM("default", show_progress=False, num_threads=1)
    from hearth_llm.kernels.quant import gguf_cpu_native

    if (exact.engine.runner.dtype == torch.bfloat16 and not gguf_cpu_native.has_bf16("Q4_1")) \
            or not gguf_cpu_q8x.has_panels():
        pytest.skip("the int8 linears need their panel kernels (AVX-512 VNNI or AVX2), and in bf16 the blocks kept")
    llm = LLM("default", show_progress=False, num_threads=1, cpu_int8_activations=True)
    head = llm.engine.runner.model.lm_head
    # the Q8_0 head: int8 where that pays (AVX-512 VNNI), its exact kernel on AVX2 (gguf_cpu_q8x.supports)
    head_on_int8 = gguf_cpu_q8x.supports(head.quant_type, head.blocks.shape[0])
    assert isinstance(head, CpuBlockLogitsHead) and (head.int8_gemv is not None) == head_on_int8
    from hearth_llm.engine.models.linear import linear_layers

    routines = {layer.routine.__name__ for _, layer in linear_layers(llm.engine.runner.model)}
    assert routines == {"int8_or_fallback"}  # all 120 Q4_1 linears
    prompts = ["The capital of France is", "1, 2, 3, 4, 5, 6, 7,"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    plain = llm.generate(prompts, params)
    reference = exact.generate(prompts, params)
    # int8 activations move the logits a little: the greedy answer starts the same here
    assert [out.outputs[0].token_ids[:4] for out in plain] == [out.outputs[0].token_ids[:4] for out in reference]
    del exact
    spec = LLM("default", show_progress=False, num_threads=1, cpu_int8_activations=True,
               speculative={"method": "ngram", "num_speculative_tokens": 4})
    # verify rows get a one-row step's bits: speculative greedy is plain greedy, token for token
    assert [out.outputs[0].token_ids for out in spec.generate(prompts, params)] == \
        [out.outputs[0].token_ids for out in plain]
    # a level-2 sleep reloads the model: the wake puts the int8 kernels back (same tokens, same routines)
    llm.sleep(level=2)
    llm.wake_up()
    assert {layer.routine.__name__ for _, layer in linear_layers(llm.engine.runner.model)} == {"int8_or_fallback"}
    assert (llm.engine.runner.model.lm_head.int8_gemv is not None) == head_on_int8
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == \
        [out.outputs[0].token_ids for out in plain]


def test_q8_0_block_layers_of_a_tiny_gguf_run_int8_steps(tmp_path):
    from gguf_writer import add_block_layers, add_q8_0_embedding_and_norm, tiny_llama_writer, write_and_close
    from test_quant_gguf import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, _layer_blocks

    from conftest import TINY_VOCAB
    from hearth_llm.engine import LLM, SamplingParams
    from hearth_llm.engine.models.linear import linear_layers
    from hearth_llm.engine.models.gguf_linear_method import GGUFInt4LinearMethod
    from hearth_llm.engine.models.quant import GGUFBlockLinearMethod
    from hearth_llm.kernels.quant import gguf_cpu_native

    if not gguf_cpu_q8x.has_panels():
        pytest.skip("the int8 path needs its panel kernels (AVX-512 VNNI or AVX2)")
    # bf16 engines keep the Q8_0 blocks (AVX-512 BF16 kernels); float32 ones the AVX2 panels, whose blocks the
    # int8 panels are made from
    dtype = "bfloat16" if gguf_cpu_native.has_bf16("Q8_0") else "float32"
    path = tmp_path / "q8_0.gguf"
    writer = tiny_llama_writer(path, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS)
    add_q8_0_embedding_and_norm(writer, TINY_VOCAB, HIDDEN)  # tied head: Q8_0 blocks
    add_block_layers(writer, [("Q8_0",) * 7] * LAYERS, HIDDEN, _layer_blocks)
    write_and_close(writer)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    if not gguf_cpu_q8x.supports("Q8_0", 16):  # AVX2: Q8_0 stays exact, so this model has nothing to switch
        with pytest.raises(ValueError, match="cpu_int8_activations=True found no"):
            LLM(str(path), dtype=dtype, device="cpu", show_progress=False, num_threads=1, cpu_int8_activations=True)
        return
    with LLM(str(path), dtype=dtype, device="cpu", show_progress=False, num_threads=1,
             cpu_int8_activations=True) as llm:
        layers = dict(linear_layers(llm.engine.runner.model))
        assert {type(layer.method) for layer in layers.values()} == \
            {GGUFBlockLinearMethod if dtype == "bfloat16" else GGUFInt4LinearMethod}
        assert {layer.routine.__name__ for layer in layers.values()} == {"int8_or_fallback"}
        assert llm.engine.runner.model.lm_head.int8_gemv is not None
        plain = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(path), dtype=dtype, device="cpu", show_progress=False, num_threads=1,
             cpu_int8_activations=True, speculative={"method": "ngram", "num_speculative_tokens": 4,
                                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3}) as llm:
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == plain


@pytest.mark.parametrize("quant_type", ["Q4_K", "Q6_K"])
def test_k_quant_panels_match_the_reference_and_gguf_py(quant_type):
    if not gguf_cpu_q8x.has_panels():
        pytest.skip("no AVX-512 VNNI or AVX2: the panel kernels are not in this build")
    data = random_blocks(quant_type, 32, 3 * 256, seed=7)
    x = _x(8, 3 * 256, seed=8)
    dequantized = torch.from_numpy(np.ascontiguousarray(
        gguf_dequantize(data.numpy(), GGMLQuantizationType[quant_type]).reshape(32, -1).astype(np.float32)))
    q, d, sums = gguf_cpu_q8x.quantize_rows_reference(x)
    if quant_type == "Q4_K":
        codes, dw, mw = gguf_cpu_q8x.block_codes(data, "Q4_K")
        # the reference's sub-block factors are the file's weights: (d sc) q - dmin mn, bit for bit
        assert torch.equal((dw[..., None] * codes.float() + mw[..., None]).reshape(32, -1), dequantized)
        terms = (torch.einsum("nbj,mbj->mnb", codes.double(), q.reshape(8, -1, 32).double()).abs()
                 * (dw[None] * d[:, None]).double() + (mw[None] * sums[:, None]).double().abs())
    else:
        codes, scale = gguf_cpu_q8x.q6_k_codes(data)
        assert torch.equal((scale[..., None] * codes.float()).reshape(32, -1), dequantized)  # (d sc) (q - 32)
        terms = (torch.einsum("nbj,mbj->mnb", codes.double(), q.reshape(8, -1, 16).double()).abs()
                 * (scale[None] * d.repeat_interleave(2, dim=1)[:, None]).double().abs())
    assert gguf_cpu_q8x.supports(quant_type, 32) and not gguf_cpu_q8x.supports(quant_type, 8)
    assert not gguf_cpu_q8x.supports("Q5_K", 32)
    gemv = gguf_cpu_q8x.panel_gemv_routine(gguf_cpu_q8x.pack(data, quant_type), quant_type)
    full = gemv(x)
    reference = gguf_cpu_q8x.reference(x, data, quant_type)
    assert ((full.double() - reference.double()).abs() <= terms.sum(-1) * 2e-6 + 1e-30).all()
    for rows in (1, 2, 5):
        assert torch.equal(gemv(x[:rows]), full[:rows])
    exact = x.double() @ dequantized.double().T
    _, scales, _ = gguf_cpu_q8x.quantize_rows(x)
    bound = dequantized.double().abs() @ (scales.double().repeat_interleave(32, dim=1) * 0.5).T
    assert ((full.double() - exact).abs() <= bound.T * (1 + 1e-4) + 1e-6 * exact.abs()).all()
