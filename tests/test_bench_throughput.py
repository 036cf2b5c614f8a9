"""``hearth-llm bench throughput``'s checkpoints and its whole path on CPU: the shapes it builds are
the ones named, MoE checkpoints carry the per-expert names real hub checkpoints carry (checked by
transformers loading them), and a tiny shape runs end to end in seconds, so a change that breaks the
H200 run fails here first."""
import argparse
import json
import math
import weakref

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hearth_llm.benchmarks import throughput
from hearth_llm.benchmarks.random_weights import RandomWeights, checkpoint_shapes, hub_state_dict

MOE_SHAPES = ["tiny-qwen3-moe", "tiny-mixtral"]


def test_config_class_follows_the_exact_architecture():
    config = throughput.hf_config("qwen3-30b-a3b", num_layers=2)
    assert type(config).__name__ == "Qwen3MoeConfig"
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
    assert config.norm_topk_prob is True and config.head_dim == 128
    assert type(throughput.hf_config("mixtral-8x7b", num_layers=1)).__name__ == "MixtralConfig"
    assert type(throughput.hf_config("qwen3-0.6b", num_layers=1)).__name__ == "Qwen3Config"


def test_an_architecture_without_a_config_class_is_refused(monkeypatch):
    monkeypatch.setitem(throughput.SHAPES, "odd", dict(architecture="Qwen3NextForCausalLM", hidden_size=64))
    with pytest.raises(ValueError, match="Qwen3NextForCausalLM"):
        throughput.hf_config("odd")


@pytest.mark.parametrize("shape, billions, layer_tensors", [("qwen3-30b-a3b", 30.53, 9 + 3 * 128),
                                                            ("mixtral-8x7b", 46.70, 7 + 3 * 8)])
def test_the_moe_shapes_have_their_models_sizes(shape, billions, layer_tensors):
    config = throughput.hf_config(shape)
    shapes = checkpoint_shapes(config, torch.bfloat16)  # a meta-device model: nothing allocated
    assert round(sum(math.prod(s) for s in shapes.values()) / 1e9, 2) == billions
    assert len(shapes) == 3 + config.num_hidden_layers * layer_tensors  # embed, norm, lm_head + per layer


@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_moe_checkpoints_use_hub_names_that_transformers_loads(shape, tmp_path):
    model, checkpoint = throughput.random_model(shape, torch.float32, "cpu")
    names = list(checkpoint.state_dict)
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in names)
    config = model.config
    save_file({name: tensor.clone() for name, tensor in checkpoint.state_dict.items()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp_path)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_hub_names_split_fused_experts_into_views_without_copying():
    model, _ = throughput.random_model("tiny-qwen3-moe", torch.float32, "cpu")
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    hub = hub_state_dict(model.state_dict(), model.config)
    up = hub["model.layers.1.mlp.experts.5.up_proj.weight"]
    assert up.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert torch.equal(up, fused[5, 32:]) and torch.equal(hub["model.layers.1.mlp.experts.5.gate_proj.weight"],
                                                          fused[5, :32])


def test_hub_names_refuse_a_fused_layout_other_than_expected():
    model, _ = throughput.random_model("tiny-qwen3-moe", torch.float32, "cpu")
    state_dict = dict(model.state_dict())
    name = "model.layers.0.mlp.experts.down_proj"
    state_dict[name] = state_dict[name].transpose(1, 2)  # [E, I, H], as some quantized layouts store it
    with pytest.raises(ValueError, match="experts.down_proj"):
        hub_state_dict(state_dict, model.config)


@pytest.mark.parametrize("shape", ["tiny-qwen3", *MOE_SHAPES])
def test_random_checkpoint_has_the_hf_models_names_shapes_and_size(shape):
    model, reference = throughput.random_model(shape, torch.float32, "cpu")
    weights, checkpoint = throughput.random_checkpoint(shape, torch.float32, "cpu")
    expected = {name: tuple(t.shape) for name, t in reference.state_dict.items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert weights.shapes == expected
    assert {name: dims for name, (dims, _) in checkpoint.weight_shapes().items()} == expected
    assert weights.num_bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def test_random_checkpoint_streams_without_holding_what_it_yielded():
    weights, checkpoint = throughput.random_checkpoint("tiny-qwen3-moe", torch.float32, "cpu")
    stream = checkpoint.weights()
    name, tensor = next(stream)
    assert tuple(tensor.shape) == weights.shapes[name]
    yielded = weakref.ref(tensor)
    del tensor
    next(stream)
    assert yielded() is None  # freed: the device holds the model plus one tensor while loading
    assert len(list(stream)) == len(weights) - 2


def test_random_weights_are_made_when_read_and_the_same_each_time():
    shapes = {"model.norm.weight": (8,), "model.layers.0.mlp.gate.weight": (4, 8), "x.bias": (3,)}
    weights = RandomWeights(shapes, torch.float32, "cpu", std=0.02)
    first, again = weights["model.layers.0.mlp.gate.weight"], weights["model.layers.0.mlp.gate.weight"]
    assert first is not again and torch.equal(first, again)
    assert 0.005 < first.std().item() < 0.05
    assert torch.equal(weights["model.norm.weight"], torch.ones(8)) and torch.equal(weights["x.bias"], torch.zeros(3))
    other_seed = RandomWeights(shapes, torch.float32, "cpu", std=0.02, seed=1)
    assert not torch.equal(other_seed["model.layers.0.mlp.gate.weight"], first)


@pytest.mark.parametrize("shape", ["tiny-qwen3", *MOE_SHAPES])
def test_the_bench_runs_end_to_end_on_cpu(shape, tmp_path, capsys):
    out = tmp_path / "result.json"
    throughput.main(["--shape", shape, "--device", "cpu", "--no-hf", "--num-seqs", "3", "--lengths", "8", "12",
                     "--kv-cache-memory", "16MiB", "--json", str(out)])
    result = json.loads(out.read_text())
    requests = throughput.workload(3, low=8, high=12)
    assert result["ours"]["output_tokens"] == sum(max_tokens for _, max_tokens in requests)
    assert result["ours"]["preemptions"] == 0
    config = throughput.hf_config(shape)
    assert result["weight_bytes"] == 2 * sum(math.prod(s) for s in checkpoint_shapes(config, torch.bfloat16).values())
    assert result["ours_bs1_ms_per_token"] > 0 and "hf_continuous_batching" not in result
    if shape in MOE_SHAPES:  # a decoded token reads top_k of each layer's experts
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        unread = config.num_hidden_layers * (num_experts - config.num_experts_per_tok) * 3 * intermediate * 64 * 2
        assert result["active_weight_bytes"] == result["weight_bytes"] - unread
    else:
        assert "active_weight_bytes" not in result
    assert json.loads(capsys.readouterr().out.partition("\n")[0])["output_tokens"] == result["ours"]["output_tokens"]


def test_cpu_runs_need_no_hf():
    with pytest.raises(SystemExit) as exit_info:
        throughput.main(["--shape", "tiny-qwen3", "--device", "cpu"])
    assert exit_info.value.code == 2


def test_the_hf_column_is_refused_before_building_when_two_copies_cannot_fit(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (139 * 2**30, 139 * 2**30))  # an H200
    with pytest.raises(SystemExit) as exit_info:
        throughput.main(["--shape", "qwen3-30b-a3b"])
    assert exit_info.value.code == 2
    assert "--no-hf" in capsys.readouterr().err


def test_the_dense_shapes_keep_their_hf_column_on_an_h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (139 * 2**30, 139 * 2**30))
    parser = argparse.ArgumentParser()
    for shape in ("qwen3-0.6b", "llama3-8b"):
        throughput.check_room_for_hf(parser, shape, "40GiB")  # returns; parser.error would exit
