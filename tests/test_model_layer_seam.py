"""The model layer seam: linear layers load their checkpoint slices, methods are chosen before
loading, GGUF Q4 blocks become int4 weights exactly, checkpoints stream and bad ones are refused
(naming the file and weight) before anything is read, leaving nothing in memory."""
from __future__ import annotations

import gc
import json

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.loader import hf_dir, load_checkpoint
from hearth_llm.engine.loader.gguf_blocks import GGUFBlocks
from hearth_llm.engine.models.decoder import DecoderModel
from hearth_llm.engine.models.gguf_linear_method import GGUFInt4LinearMethod
from hearth_llm.engine.models.linear import (ColumnLinear, MergedColumnLinear, QKVLinear, RowLinear, TensorParallel,
                                             configure_linears)
from hearth_llm.engine.models.linear_method import DenseLinearMethod

from conftest import TINY_COMMON
from model_equality import save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- linear layers ------------------------------------------------------------------------------


def test_qkv_shards_land_in_their_rows():
    qkv = QKVLinear(hidden_size=16, head_dim=4, num_heads=4, num_kv_heads=2)
    q, k, v = randn(16, 16, seed=1), randn(8, 16, seed=2), randn(8, 16, seed=3)
    for shard, tensor in (("v", v), ("q", q), ("k", k)):  # any order
        qkv.weight.weight_loader(qkv.weight, tensor, shard)
    assert torch.equal(qkv.weight, torch.cat((q, k, v)))


def test_a_fused_checkpoint_tensor_loads_into_every_shard():
    gate_up = MergedColumnLinear(16, [24, 24])
    fused = randn(48, 16)
    gate_up.weight.weight_loader(gate_up.weight, fused)
    assert torch.equal(gate_up.weight, fused)


@pytest.mark.parametrize("bad_shape", [(9, 16), (8, 15)])
def test_a_shard_of_the_wrong_shape_is_refused_by_name(bad_shape):
    qkv = QKVLinear(hidden_size=16, head_dim=4, num_heads=4, num_kv_heads=2, prefix="layers.0.self_attn.qkv_proj")
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj\.weight \(shard 'k'\)"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(bad_shape), "k")


def test_an_unknown_shard_id_is_refused():
    qkv = QKVLinear(16, 4, 4, 2)
    with pytest.raises(ValueError, match="shard id 'x'"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(8, 16), "x")


def _tensor_parallel_copies(make_layer, size: int, load):
    layers = []
    for rank in range(size):
        layer = make_layer()
        layer.configure(parallel=TensorParallel(rank=rank, size=size))
        load(layer)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_tensor_parallel_ranks_of_qkv_and_o_proj_compute_the_single_rank_product(num_kv_heads):
    """Column-parallel QKV then row-parallel o_proj over 4 ranks, partial sums added as an all-reduce
    would, equal one rank computing everything (KV heads replicated when fewer than ranks)."""
    hidden, head_dim, num_heads, size = 32, 4, 8, 4
    q, k, v = randn(num_heads * head_dim, hidden, seed=1), randn(num_kv_heads * head_dim, hidden, seed=2), \
        randn(num_kv_heads * head_dim, hidden, seed=3)
    o, bias = randn(hidden, num_heads * head_dim, seed=4), randn(hidden, seed=5)

    def load_qkv(layer):
        for shard, tensor in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, tensor, shard)

    def load_o(layer):
        layer.weight.weight_loader(layer.weight, o)
        layer.bias.weight_loader(layer.bias, bias)

    x = randn(3, hidden, seed=6)
    qkv_ranks = _tensor_parallel_copies(lambda: QKVLinear(hidden, head_dim, num_heads, num_kv_heads), size, load_qkv)
    o_ranks = _tensor_parallel_copies(lambda: RowLinear(num_heads * head_dim, hidden, bias=True), size, load_o)
    queries_per_rank = num_heads // size * head_dim
    partial_sums = []
    for qkv, o_proj in zip(qkv_ranks, o_ranks):
        rank_q = qkv(x)[:, :queries_per_rank]
        partial_sums.append(o_proj.method.apply(o_proj, rank_q, o_proj.bias))  # bias only on rank 0
    expected = F.linear(F.linear(x, q), o, bias)
    torch.testing.assert_close(sum(partial_sums), expected)
    # every rank holds the KV heads its query heads attend with
    for rank, qkv in enumerate(qkv_ranks):
        kv_head = rank * num_heads // size // (num_heads // num_kv_heads)
        assert torch.equal(qkv.weight[queries_per_rank:queries_per_rank + head_dim], k[kv_head * head_dim:][:head_dim])


def test_column_parallel_ranks_hold_consecutive_rows():
    weight = randn(12, 8)
    ranks = _tensor_parallel_copies(lambda: ColumnLinear(8, 12), 3,
                                    lambda layer: layer.weight.weight_loader(layer.weight, weight))
    assert torch.equal(torch.cat([layer.weight for layer in ranks]), weight)


class RecordingMethod(DenseLinearMethod):
    def __init__(self):
        self.calls = []

    def create_weights(self, layer):
        self.calls.append("create_weights")
        super().create_weights(layer)

    def load_weight(self, layer, name, param, loaded, offset):
        self.calls.append("load_weight")
        super().load_weight(layer, name, param, loaded, offset)

    def process_weights_after_loading(self, layer):
        self.calls.append("process")

    def apply(self, layer, x, bias):
        self.calls.append("apply")
        return super().apply(layer, x, bias) * 2


def test_a_method_chosen_before_loading_creates_loads_processes_and_applies(tiny_model_dirs):
    checkpoint = load_checkpoint(str(tiny_model_dirs["llama"]), torch.float32, progress=False)
    model_class = type(checkpoint.config)  # noqa: F841 - the config class is not the model class
    from hearth_llm.engine.models import model_class_for

    cls = model_class_for(checkpoint.config)
    model = cls(cls.arch_from_hf_config(checkpoint.config))
    method = RecordingMethod()
    configure_linears(model, lambda name, layer: method if name == "layers.1.mlp.down_proj" else None)
    model.materialize_buffers(torch.float32)
    model.load_weights(checkpoint.weights())
    down = model.layers[1].mlp.down_proj
    x = randn(2, down.input_size)
    assert torch.equal(down(x), 2 * F.linear(x, down.weight))
    assert method.calls == ["create_weights", "load_weight", "process", "apply"]
    assert type(model.layers[0].mlp.down_proj.method) is DenseLinearMethod


# --- GGUF blocks and the int4 method ------------------------------------------------------------------


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_bit_equal_to_gguf_py(quant_type):
    values = (randn(48, 256, seed=7) * 0.3).numpy()
    data = quantize(values, gguf.GGMLQuantizationType[quant_type])
    blocks = GGUFBlocks(quant_type, torch.from_numpy(data))
    expected = torch.from_numpy(dequantize(data, gguf.GGMLQuantizationType[quant_type]))
    assert blocks.shape == (48, 256)
    assert torch.equal(blocks.dequantized(torch.float32), expected)
    codes, scales, zeros = blocks.int4_parts()
    rebuilt = (codes.float().view(48, 8, 32) - 8) * scales[..., None] + zeros[..., None]
    torch.testing.assert_close(rebuilt.view(48, 256), expected, rtol=0, atol=1e-6)
    assert torch.equal(blocks.narrow(1, 64, 96).dequantized(), expected[:, 64:160])
    assert torch.equal(blocks.narrow(0, 5, 7).dequantized(), expected[5:12])


def test_gguf_blocks_refuse_a_column_cut_inside_a_block():
    blocks = GGUFBlocks("Q4_0", torch.zeros(4, 36, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiples of 32"):
        blocks.narrow(1, 16, 32)


def _quantized_tiny_llama_gguf(tmp_path, quant_type: str):
    """The tiny Llama of test_gguf_loader with every linear weight quantized to ``quant_type``."""
    from test_gguf_loader import llama_cpp_tensors, tiny_llama_state_dict, write_tiny_gguf

    tensors = llama_cpp_tensors(tiny_llama_state_dict())
    quantized = {}
    for name, array in tensors.items():
        if array.ndim == 2 and name.startswith("blk."):
            quantized[name] = (quantize(array * 0.1, gguf.GGMLQuantizationType[quant_type]), quant_type)
        else:
            quantized[name] = (array * 0.1 if array.ndim == 2 else np.abs(array), None)
    writer_tensors = {name: array for name, (array, _) in quantized.items()}
    path = tmp_path / f"tiny-{quant_type}.gguf"
    original_add = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, array, *args, **kwargs):
        quant = quantized[name][1]
        if quant is not None:  # the array holds the blocks' bytes
            kwargs["raw_dtype"] = gguf.GGMLQuantizationType[quant]
        return original_add(self, name, array, *args, **kwargs)

    gguf.GGUFWriter.add_tensor = add_tensor
    try:
        write_tiny_gguf(path, writer_tensors)
    finally:
        gguf.GGUFWriter.add_tensor = original_add
    return path


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1"])
def test_q4_gguf_in_bf16_runs_int4_weights_packed_from_the_blocks(quant_type, tmp_path, monkeypatch):
    from hearth_llm.engine.loader import model_loader
    from hearth_llm.kernels import cpu_ops

    if not cpu_ops.has_onednn_bf16():
        pytest.skip("no bf16 oneDNN on this CPU")
    path = _quantized_tiny_llama_gguf(tmp_path, quant_type)
    checkpoint = load_checkpoint(str(path), torch.bfloat16, progress=False)
    assert set(checkpoint.weight_formats.values()) == {quant_type}
    fp32_reference = dict(checkpoint.weights())  # GGUFBlocks under HF names
    # No "is it on a 4-bit grid?" search: the method comes from the tensor types.
    monkeypatch.setattr(cpu_ops, "int4_weight_if_lossless", lambda *a: pytest.fail("searched for a 4-bit grid"))
    model, _ = model_loader.load_model(checkpoint, torch.device("cpu"), torch.bfloat16)
    linears = [m for m in model.modules() if hasattr(m, "method")]
    assert {type(m.method) for m in linears} == {GGUFInt4LinearMethod}
    o_proj = model.layers[1].self_attn.o_proj
    weight = fp32_reference["model.layers.1.self_attn.o_proj.weight"].dequantized(torch.float32)
    x = randn(1, weight.shape[1], seed=8).bfloat16()
    int4_out = o_proj(x).float()  # one row: the C Q4 kernel on the blocks (AVX-512 BF16), else the int4 kernel
    torch.testing.assert_close(int4_out, x.float() @ weight.T, rtol=0.02, atol=0.02)
    # The blocks themselves (the C kernels; with AMX the dense copy is dropped), else int4 packed from them.
    cpu_weight = o_proj.cpu_weight
    assert o_proj.method.block_runs(o_proj) is not None or (cpu_weight is not None and cpu_weight.int4 is not None)


def test_a_cpu_load_hands_its_freed_temporaries_back_once(tmp_path, monkeypatch):
    from hearth_llm.engine.loader import model_loader
    from hearth_llm.kernels import cpu_ops

    path = _quantized_tiny_llama_gguf(tmp_path, "Q4_1")
    calls = []
    monkeypatch.setattr(cpu_ops, "release_freed_heap", lambda: calls.append(1) or True)
    model, _ = model_loader.load_model(load_checkpoint(str(path), torch.bfloat16, progress=False),
                                       torch.device("cpu"), torch.bfloat16)
    assert len(calls) == 1 and model is not None


def test_release_freed_heap_trims_on_glibc():
    import platform

    from hearth_llm.kernels import cpu_ops

    result = cpu_ops.release_freed_heap()
    assert isinstance(result, bool)
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        garbage = [bytearray(1 << 16) for _ in range(256)]  # 16 MiB of freed small-heap pages to hand back
        del garbage
        assert cpu_ops.release_freed_heap()


def test_q4_gguf_in_float32_is_dequantized_exactly(tmp_path):
    path = _quantized_tiny_llama_gguf(tmp_path, "Q4_1")
    checkpoint = load_checkpoint(str(path), torch.float32, progress=False)
    blocks = dict(checkpoint.weights())
    llm = LLM(str(path), dtype="float32", show_progress=False)
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    expected_k = blocks["model.layers.0.self_attn.k_proj.weight"].dequantized(torch.float32)
    # Dense float32, or (AVX2 CPUs) the file's blocks as panels, which decode to the same values (no dense copy).
    panels = getattr(qkv.method, "panel_runs", lambda layer: None)(qkv)
    assert type(qkv.method) is DenseLinearMethod or panels is not None
    if panels is None:
        weight = qkv.weight
    else:
        from hearth_llm.kernels.quant import gguf_cpu_native

        assert "weight" not in qkv._parameters
        weight = torch.cat([gguf_cpu_native.dequantize_panels(data, quant_type) for quant_type, data in panels])
    assert torch.equal(weight[64:96], expected_k)
    llm.close()


# --- streaming and bad checkpoints -------------------------------------------------------------------


def test_opening_a_checkpoint_reads_no_weights(tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(hf_dir, "_stream_safetensors", lambda *a: pytest.fail("weights read on open"))
    checkpoint = load_checkpoint(str(tiny_model_dirs["llama"]), torch.float32, progress=False)
    shape, file = checkpoint.weight_shapes()["model.layers.0.self_attn.q_proj.weight"]
    assert shape == (64, 64) and file.endswith("model.safetensors")


def test_weights_stream_one_at_a_time(tiny_model_dirs):
    checkpoint = load_checkpoint(str(tiny_model_dirs["llama"]), torch.float32, progress=False)
    stream = checkpoint.weights()
    name, tensor = next(stream)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor)
    assert len(list(stream)) == len(checkpoint.weight_shapes()) - 1


def _broken_copy(tiny_model_dirs, tmp_path, edit):
    import shutil

    target = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], target)
    weights = load_file(target / "model.safetensors")
    edit(weights)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("edit, match", [
    (lambda w: w.__setitem__("model.layers.1.mlp.up_proj.weight", torch.zeros(100, 64)),
     r"model\.safetensors: weight 'model\.layers\.1\.mlp\.up_proj\.weight' has shape \(100, 64\).*makes it \(128, 64\)"),
    (lambda w: w.pop("model.layers.0.self_attn.v_proj.weight"),
     r"model is missing weights: model\.layers\.0\.self_attn\.v_proj\.weight$"),
    (lambda w: w.__setitem__("model.layers.0.self_attn.rotary_scale.weight", torch.zeros(4)),
     r"model\.safetensors: weight 'model\.layers\.0\.self_attn\.rotary_scale\.weight' is not a weight"),
    (lambda w: w.pop("lm_head.weight"), r"model is missing weights: lm_head\.weight$"),
])
def test_a_checkpoint_that_does_not_match_its_config_is_refused_before_reading(edit, match, tiny_model_dirs,
                                                                            tmp_path, monkeypatch):
    target = _broken_copy(tiny_model_dirs, tmp_path, edit)
    monkeypatch.setattr(hf_dir, "_stream_safetensors", lambda *a: pytest.fail("weights read before the check"))
    with pytest.raises(ValueError, match=match):
        LLM(str(target), show_progress=False)


def test_a_load_failing_midway_leaves_no_model_in_memory(tiny_model_dirs, monkeypatch):
    real_stream = hf_dir._stream_safetensors

    def fails_after_three(*args):
        for count, item in enumerate(real_stream(*args)):
            if count == 3:
                raise ValueError("model: cannot read weights file 'model.safetensors': disk gone")
            yield item

    monkeypatch.setattr(hf_dir, "_stream_safetensors", fails_after_three)
    gc.collect()
    before = sum(issubclass(type(obj), DecoderModel) for obj in gc.get_objects())
    with pytest.raises(ValueError, match="disk gone") as caught:
        LLM(str(tiny_model_dirs["qwen3"]), show_progress=False)
    gc.collect()
    assert caught.value is not None  # the caller still holds the exception...
    assert sum(issubclass(type(obj), DecoderModel) for obj in gc.get_objects()) == before  # ...but no model


def test_a_streamed_bf16_load_keeps_each_weight_once(tmp_path):
    """After loading, a bf16 CPU model holds its packed copies, not the plain weights as well."""
    from hearth_llm.kernels import cpu_ops

    if not cpu_ops.has_onednn_bf16():
        pytest.skip("no bf16 oneDNN on this CPU")
    config = LlamaConfig(**{**TINY_COMMON, "vocab_size": 320}, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    path = save_tiny_model(config, tmp_path / "tiny")
    llm = LLM(str(path), dtype="bfloat16", show_progress=False)
    model = llm.engine.runner.model
    for layer in model.layers:
        assert not hasattr(layer.mlp.down_proj, "weight") and layer.mlp.down_proj.cpu_weight.packed_weight is not None
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    llm.close()


def test_sharded_safetensors_stream_file_by_file(tmp_path, tiny_model_dirs, make_llm):
    import shutil

    target = tmp_path / "sharded"
    shutil.copytree(tiny_model_dirs["llama"], target)
    weights = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    names = sorted(weights)
    index = {}
    for number, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-0000{number + 1}-of-00002.safetensors"
        save_file({name: weights[name] for name in part}, target / file, metadata={"format": "pt"})
        index.update(dict.fromkeys(part, file))
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    sharded = make_llm(target).generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    whole = make_llm(tiny_model_dirs["llama"]).generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert sharded == whole
