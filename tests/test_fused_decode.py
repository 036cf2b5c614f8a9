"""Batch-size-1 decode with RMSNorm and SwiGLU inside the matmuls (kernels/gemv, engine/models/fused_decode.py):
the Triton kernels against their torch reference (in the interpreter on CPU), and the engine with the
fused path forced on CPU against HF greedy; on CUDA, bf16 closeness on real widths."""
import pytest
import torch

from hearth_llm.engine.models import cpu_step, fused_decode
from hearth_llm.kernels.gemv import reference

from conftest import TINY_CONFIGS, random_prompts
from model_equality import GREEDY, assert_matches_hf, save_tiny_model

triton_gemv = pytest.importorskip("hearth_llm.kernels.gemv.triton_gemv")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Ragged on purpose: K not a multiple of the K tile, N not one of the N tile.
TINY = triton_gemv.GemvLaunch(block_n=8, block_k=32)


def _inputs(rows, reduction, outputs, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    return draw(rows, reduction), draw(rows, reduction), draw(reduction), draw(outputs, reduction)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows", [1, 2])
def test_rms_norm_linear_matches_reference(with_residual, rows):
    x, residual, norm_weight, weight = _inputs(rows, 72, 20)
    residual = residual if with_residual else None
    out, summed = triton_gemv.rms_norm_linear(x, residual, norm_weight, 1e-5, weight, TINY)
    expected_out, expected_summed = reference.rms_norm_linear(x, residual, norm_weight, 1e-5, weight)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(summed, expected_summed, rtol=0, atol=0)


@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_linear_with_swiglu_epilogue_matches_reference(with_residual):
    x, residual, norm_weight, weight = _inputs(2, 72, 2 * 9, seed=2)  # 9 outputs: ragged against 4 a program
    residual = residual if with_residual else None
    launch = triton_gemv.GemvLaunch(block_n=4, block_k=32)
    act, summed = triton_gemv.rms_norm_linear_silu_and_mul(x, residual, norm_weight, 1e-5, weight, launch)
    expected_act, expected_summed = reference.rms_norm_linear_silu_and_mul(x, residual, norm_weight, 1e-5, weight)
    assert act.shape == (2, 9)
    torch.testing.assert_close(act, expected_act, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(summed, expected_summed, rtol=0, atol=0)
    with pytest.raises(ValueError, match="gate and up"):
        triton_gemv.rms_norm_linear_silu_and_mul(x, residual, norm_weight, 1e-5, weight[:17])


def test_silu_and_mul_linear_and_plain_linear_match_reference():
    x, _, _, weight = _inputs(2, 40, 12, seed=1)
    gate_up = torch.cat([x, 2 * x.flip(1)], dim=1)
    torch.testing.assert_close(triton_gemv.silu_and_mul_linear(gate_up, weight, TINY),
                               reference.silu_and_mul_linear(gate_up, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(triton_gemv.linear(x, weight, TINY), reference.linear(x, weight),
                               rtol=1e-5, atol=1e-5)
    # The default launch (one K tile covers these widths): same answer.
    torch.testing.assert_close(triton_gemv.linear(x, weight), reference.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused_by_name():
    x, residual, norm_weight, weight = _inputs(1, 16, 8)
    with pytest.raises(ValueError, match="norm_weight"):
        triton_gemv.rms_norm_linear(x, residual, norm_weight[:8], 1e-5, weight)
    with pytest.raises(ValueError, match="residual"):
        triton_gemv.rms_norm_linear(x, residual[:, :8], norm_weight, 1e-5, weight)
    with pytest.raises(ValueError, match="weight"):
        triton_gemv.rms_norm_linear(x, residual, norm_weight, 1e-5, weight[:, :8])
    with pytest.raises(ValueError, match="gate and up"):
        triton_gemv.silu_and_mul_linear(x, weight)


@pytest.fixture
def fused_on_this_device(monkeypatch):
    """The fused path on this device's tensors (on CPU: the Triton interpreter), counting its calls."""
    calls = {"rms_norm_linear": 0, "silu_and_mul_linear": 0, "linear": 0, "rms_norm_linear_silu_and_mul": 0}
    for name in calls:
        original = getattr(triton_gemv, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(triton_gemv, name, counted)
    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", frozenset({DEVICE}))
    monkeypatch.setattr(cpu_step, "ENABLED", False)  # on CPU the C step would take these steps first
    monkeypatch.setattr(fused_decode, "PLAIN_GEMV", True)
    monkeypatch.setattr(fused_decode, "LM_HEAD_GEMV", True)
    if DEVICE == "cpu":  # the interpreter runs programs one by one: a tile covers a tiny layer
        monkeypatch.setattr(triton_gemv, "default_launch", lambda *args: triton_gemv.GemvLaunch(256, 128))
    return calls


@pytest.mark.parametrize("swiglu_epilogue", [False, True])
@pytest.mark.parametrize("name", ["qwen3"])
def test_engine_with_fused_decode_matches_hf_greedy(name, swiglu_epilogue, tmp_path, make_llm, fused_on_this_device,
                                                    monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("the HF-equality run is the CPU one (fp32); CUDA runs the bf16 check below")
    monkeypatch.setattr(fused_decode, "SWIGLU_EPILOGUE", swiglu_epilogue)
    path = save_tiny_model(TINY_CONFIGS[name](), tmp_path / name, seed=3)
    llm = make_llm(path, dtype="float32")
    prompts = random_prompts(2, [1, 23], seed=21)
    for prompt in prompts:  # alone: every decode step is one row
        assert_matches_hf(path, [prompt], llm.generate([prompt], GREEDY, use_tqdm=False))
    num_layers = TINY_CONFIGS[name]().num_hidden_layers
    # Two fused norms and one fused SwiGLU per layer per one-row step (15 decode steps each, and a
    # one-token prompt's prefill).
    num_steps = num_layers * 15 * len(prompts)
    if swiglu_epilogue:  # post-attention norm + gate_up + SwiGLU in one GEMV, down_proj a plain one
        assert fused_on_this_device["rms_norm_linear"] >= num_steps
        assert fused_on_this_device["rms_norm_linear_silu_and_mul"] >= num_steps
        assert fused_on_this_device["silu_and_mul_linear"] == 0
        assert fused_on_this_device["linear"] >= 2 * num_steps  # o_proj and down_proj
    else:
        assert fused_on_this_device["rms_norm_linear"] >= 2 * num_steps
        assert fused_on_this_device["silu_and_mul_linear"] >= num_steps
        assert fused_on_this_device["rms_norm_linear_silu_and_mul"] == 0
        assert fused_on_this_device["linear"] >= num_steps  # o_proj
    # Several rows (a batch's prefill and decode) run the unfused ops and agree too.
    batch = random_prompts(3, [5, 17, 9], seed=22)
    assert_matches_hf(path, batch, llm.generate(batch, GREEDY, use_tqdm=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on real widths needs CUDA")
@pytest.mark.parametrize("reduction,outputs", [(1024, 4096), (4096, 6144), (3072, 1024)])
def test_bf16_real_widths_are_close_to_reference(reduction, outputs):
    x, residual, norm_weight, weight = _inputs(1, reduction, outputs, dtype=torch.bfloat16, seed=5)
    weight = weight * reduction**-0.5
    out, summed = triton_gemv.rms_norm_linear(x, residual, norm_weight, 1e-6, weight)
    expected_out, expected_summed = reference.rms_norm_linear(x, residual, norm_weight, 1e-6, weight)
    torch.testing.assert_close(summed, expected_summed, rtol=0, atol=0)
    torch.testing.assert_close(out.float(), expected_out.float(), rtol=2e-2, atol=2e-2)
    gate_up = torch.cat([x, residual], dim=1)
    weight_down = weight[:, :reduction // 2].contiguous()
    torch.testing.assert_close(triton_gemv.silu_and_mul_linear(gate_up[:, :reduction], weight_down).float(),
                               reference.silu_and_mul_linear(gate_up[:, :reduction], weight_down).float(),
                               rtol=2e-2, atol=2e-2)


def test_only_plain_dense_single_process_small_layers_of_one_row_take_the_fused_kernels(monkeypatch):
    from hearth_llm.engine.models.linear import ColumnLinear, TensorParallel
    from hearth_llm.engine.models.linear_method import DenseLinearMethod

    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", frozenset({"cpu"}))
    layer = ColumnLinear(16, 8)
    one_row, two_rows = torch.zeros(1, 16), torch.zeros(2, 16)
    assert fused_decode.dense_weight(layer, one_row) is layer.weight
    assert fused_decode.dense_weight(layer, two_rows) is None
    assert fused_decode.dense_weight(layer, one_row.double()) is None      # another dtype than the weight
    monkeypatch.setattr(fused_decode, "ENABLED", False)
    assert fused_decode.dense_weight(layer, one_row) is None
    monkeypatch.setattr(fused_decode, "ENABLED", True)
    assert fused_decode.dense_weight(ColumnLinear(16, 8, bias=True), one_row) is None
    wrapped = ColumnLinear(16, 8)
    wrapped.method = DenseLinearMethod()  # e.g. a LoRA or quantized method: not the shared DENSE
    assert fused_decode.dense_weight(wrapped, one_row) is None
    sharded = ColumnLinear(16, 8)
    sharded.parallel = TensorParallel(rank=0, size=2)
    assert fused_decode.dense_weight(sharded, one_row) is None
    monkeypatch.setattr(fused_decode, "MAX_WEIGHT_NUMEL", 16 * 8 - 1)  # cuBLAS reads bigger weights faster
    assert fused_decode.dense_weight(layer, one_row) is None
    monkeypatch.setattr(fused_decode, "MAX_WEIGHT_NUMEL", 16 * 8)
    assert fused_decode.dense_weight(layer, one_row) is layer.weight
    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", frozenset({"cuda"}))
    assert fused_decode.dense_weight(layer, one_row) is None


def test_programmatic_dependent_launch_only_on_cuda_tensors(monkeypatch):
    monkeypatch.setattr(triton_gemv, "USE_PDL", True)
    assert not triton_gemv.uses_pdl(torch.zeros(1))  # the interpreter has no grid dependency control
    monkeypatch.setattr(triton_gemv, "USE_PDL", False)
    assert not triton_gemv.uses_pdl(torch.zeros(1, device=DEVICE))


def test_lm_head_takes_the_gemv_only_when_asked_and_plain(monkeypatch):
    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", frozenset({DEVICE}))
    calls = []
    monkeypatch.setattr(triton_gemv, "linear", lambda x, weight: calls.append(weight) or reference.linear(x, weight))
    head, hidden = torch.nn.Linear(16, 40, bias=False).to(DEVICE), torch.randn(1, 16, device=DEVICE)
    monkeypatch.setattr(fused_decode, "LM_HEAD_GEMV", False)
    torch.testing.assert_close(fused_decode.lm_head(head, hidden), head(hidden))
    assert calls == []
    monkeypatch.setattr(fused_decode, "LM_HEAD_GEMV", True)
    torch.testing.assert_close(fused_decode.lm_head(head, hidden), head(hidden))
    assert calls == [head.weight]
    fused_decode.lm_head(head, torch.randn(2, 16, device=DEVICE))  # two rows: cuBLAS reads the head once for both
    fused_decode.lm_head(torch.nn.Linear(16, 40).to(DEVICE), hidden)  # a bias: its own forward
    assert len(calls) == 1


def test_a_methods_own_fused_kernels_run_first_and_may_decline(monkeypatch):
    """FP8's hooks: norm_and_linear / act_and_down call the method's fused kernel for one row and take
    the unfused path when it declines (returns None)."""
    from hearth_llm import kernels
    from hearth_llm.engine.models.linear import ColumnLinear
    from hearth_llm.engine.models.mlp import GatedMLP
    from hearth_llm.engine.models.norms import RMSNorm

    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", frozenset({"cpu"}))
    calls = []

    class Hooked(type(ColumnLinear(4, 4).method)):
        def __init__(self, answer):
            self.answer = answer

        def fused_rms_norm_linear(self, layer, x, residual, norm_weight, eps):
            calls.append("norm")
            return self.answer

        def fused_silu_and_mul_linear(self, layer, x):
            calls.append("silu")
            return None if self.answer is None else self.answer[0]

    norm, layer, x = RMSNorm(16, 1e-6), ColumnLinear(16, 8), torch.randn(1, 16)
    with torch.no_grad():  # the layer's weight is allocated, not initialised: it may hold NaN
        layer.weight.copy_(torch.randn(8, 16))
    answer = (torch.zeros(1, 8), x)
    layer.method = Hooked(answer)
    assert fused_decode.norm_and_linear(norm, x, None, layer) is answer
    layer.method = Hooked(None)  # declines: the unfused ops
    out, residual = fused_decode.norm_and_linear(norm, x, None, layer)
    torch.testing.assert_close(out, reference.linear(norm(x), layer.weight))
    mlp = GatedMLP(16, 8)
    mlp.down_proj.method = Hooked(answer)
    assert mlp.act_and_mul is kernels.silu_and_mul
    assert fused_decode.act_and_down(mlp, torch.randn(1, 16)) is answer[0]
    assert calls == ["norm", "norm", "silu"]


@pytest.mark.parametrize("rows,width", [(1, 40000), (3, 33000)])
def test_split_argmax_finds_each_rows_first_maximum_and_first_nan(rows, width):
    """kernels/sampling's argmax for vocabulary-wide rows that torch reduces on one CTA (Llama-3's
    128,256 on the H200): the first maximum of each row, NaN the largest, ties to the lowest index."""
    triton_sampling = pytest.importorskip("hearth_llm.kernels.sampling.triton_sampling")
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.bfloat16)
    x[0, 100] = x[0, width - 5] = 50.0              # a tie across splits: the lower index
    if rows > 1:
        x[1, width // 2] = float("nan")              # NaN beats every value, the +inf below too
        x[1, 3] = float("inf")
        x[2] = float("-inf")                          # nothing but -inf: index 0, as torch says
    assert torch.equal(triton_sampling.argmax(x), x.argmax(dim=-1))
    narrow = x[:, :1000]  # outside the widths it splits: torch's own argmax
    assert torch.equal(triton_sampling.argmax(narrow.contiguous()), narrow.argmax(dim=-1))
