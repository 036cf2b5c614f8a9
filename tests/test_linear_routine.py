"""A loaded linear layer binds its CPU kernel once (``LinearBase.routine``), so a decode step makes one
Python call per matmul; the bound routine computes what the method's ``apply`` computes, and it is
dropped whenever the method or the tensors change. The LM head's fp16 copy packs whole unless its
float32 staging copy would exceed ``CpuLogitsHead.FP16_PACK_BYTES``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hearth_llm import kernels
from hearth_llm.engine.models.cpu_weights import CpuLinear, CpuLogitsHead, cpu_logits_head
from hearth_llm.engine.models.linear import MergedColumnLinear, RowLinear
from hearth_llm.engine.models.linear_method import DenseLinearMethod
from hearth_llm.kernels import cpu_ops

needs_bf16 = pytest.mark.skipif(not cpu_ops.has_onednn_bf16(), reason="no bf16 oneDNN on this CPU")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def loaded(layer, weight):
    layer = layer.to(torch.bfloat16)
    layer.weight.weight_loader(layer.weight, weight.bfloat16())
    if layer.bias is not None:
        layer.bias.weight_loader(layer.bias, randn(layer.output_size, seed=3).bfloat16())
    layer.process_weights_after_loading()
    return layer


@needs_bf16
@pytest.mark.parametrize("num_rows", [1, 9])
def test_a_loaded_bf16_layer_runs_its_bound_routine_which_equals_apply(num_rows, monkeypatch):
    weight = randn(32, 64, seed=1).bfloat16()
    layer = loaded(RowLinear(64, 32, bias=True), weight)
    assert isinstance(layer.cpu_weight, CpuLinear) and layer.routine is not None
    x = randn(num_rows, 64, seed=2).bfloat16()
    expected = layer.method.apply(layer, x, layer.bias)
    monkeypatch.setattr(DenseLinearMethod, "apply", lambda *args: pytest.fail("dispatched through apply"))
    assert torch.equal(layer(x), expected)
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), weight.float(), layer.bias.float()),
                               atol=0.05, rtol=0.02)


@needs_bf16
def test_an_int4_layer_routine_reads_the_4bit_copy_for_few_rows_and_the_dense_one_for_more():
    from test_cpu_path import weight_on_int4_grid

    weight = weight_on_int4_grid(64, 64).bfloat16()
    layer = MergedColumnLinear(64, [32, 32]).to(torch.bfloat16)
    layer.weight.weight_loader(layer.weight, weight)
    layer.cpu_weight = CpuLinear(cpu_ops.pack_dense_weight(weight), cpu_ops.int4_weight_if_lossless(weight))
    del layer.weight
    routine = layer.cpu_weight.routine(None)
    for num_rows in (1, CpuLinear.INT4_MAX_ROWS, CpuLinear.INT4_MAX_ROWS + 1, 16):
        x = randn(num_rows, 64, seed=num_rows).bfloat16()
        assert torch.equal(routine(x), layer.cpu_weight(x)), num_rows


@needs_bf16
def test_a_new_method_after_loading_drops_the_routine():
    layer = loaded(RowLinear(64, 32), randn(32, 64, seed=1))
    calls = []

    class Wrapper(DenseLinearMethod):  # as the LoRA wrapper is put on a loaded layer
        def apply(self, layer, x, bias):
            calls.append(x.shape[0])
            return super().apply(layer, x, bias)

    layer.method = Wrapper()
    assert layer.routine is None
    layer(randn(2, 64).bfloat16())
    assert calls == [2]


def test_a_float32_layer_keeps_the_plain_product():
    layer = RowLinear(16, 8, bias=True)
    layer.weight.weight_loader(layer.weight, randn(8, 16, seed=1))
    layer.bias.weight_loader(layer.bias, randn(8, seed=2))
    layer.process_weights_after_loading()
    x = randn(3, 16, seed=4)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_bf16
@pytest.mark.parametrize("make_weight", ["dense", "onednn", "fp16", "int4"])
def test_linear_routine_equals_linear_for_every_cpu_format(make_weight):
    from test_cpu_path import weight_on_int4_grid

    plain = weight_on_int4_grid(32, 64).bfloat16()
    weight = {"dense": lambda: kernels.DenseWeight(plain), "onednn": lambda: kernels.OnednnBf16Weight.pack(plain),
              "fp16": lambda: kernels.Fp16Weight.pack(plain), "int4": lambda: kernels.Int4Weight.if_lossless(plain)}[
        make_weight]()
    bias = randn(32, seed=5).bfloat16()
    x = randn(3, 64, seed=6).bfloat16()
    assert torch.equal(kernels.linear_routine(weight, "cpu", bias)(x), kernels.linear(x, weight, bias))


def test_linear_routine_binds_a_registered_format_and_refuses_an_unknown_one():
    class Doubled(kernels.DenseWeight):
        pass

    kernels.register_linear_routine(Doubled, "cpu", lambda x, w, bias: 2 * F.linear(x, w.weight, bias))
    routine = kernels.linear_routine(Doubled(torch.ones(3, 2)), "cpu")
    assert routine(torch.ones(1, 2)).tolist() == [[4.0, 4.0, 4.0]]

    class Unknown:
        pass

    with pytest.raises(ValueError, match="no linear routine for weight format Unknown on cpu"):
        kernels.linear_routine(Unknown(), "cpu")


@needs_bf16
@pytest.mark.parametrize("pack_bytes, num_blocks", [(CpuLogitsHead.FP16_PACK_BYTES, 1), (4 * 64 * 100, 4)])
def test_the_logits_head_packs_whole_under_its_byte_bound_and_in_blocks_above(pack_bytes, num_blocks, monkeypatch):
    monkeypatch.setattr(CpuLogitsHead, "FP16_PACK_BYTES", pack_bytes)
    linear = torch.nn.Linear(64, 320, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(randn(320, 64, seed=7))
    head = cpu_logits_head(linear)
    assert isinstance(head, CpuLogitsHead) and len(head.fp16_weight) == num_blocks
    x = randn(2, 64, seed=8).bfloat16()
    torch.testing.assert_close(head(x), x.float() @ linear.weight.half().float().T, atol=1e-3, rtol=1e-3)
