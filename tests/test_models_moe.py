"""MoE architectures (Mixtral, Qwen2-MoE, Qwen3-MoE) token-equal to HF transformers greedy (fp32,
CPU) on tiny random models, their expert weight loading, and the config fields they refuse."""
import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.models import model_class_for
from hearth_llm.engine.models.moe import ExpertShard, FusedMoE

from conftest import TINY_COMMON
from model_equality import check_matches_hf, save_tiny_model

THREE_LAYERS = {**TINY_COMMON, "num_hidden_layers": 3}
QWEN_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

CONFIGS = {
    # norm_topk_prob as Qwen3-30B-A3B; layer 1 dense through mlp_only_layers.
    "qwen3_moe": lambda: Qwen3MoeConfig(**THREE_LAYERS, **QWEN_EXPERTS, head_dim=32, norm_topk_prob=True,
                                        mlp_only_layers=[1], tie_word_embeddings=False,
                                        architectures=["Qwen3MoeForCausalLM"]),
    # Unnormalised top-k, every second layer sparse, a window on all layers, q/k/v/o biases.
    "qwen3_moe_sparse_step": lambda: Qwen3MoeConfig(**THREE_LAYERS, **QWEN_EXPERTS, head_dim=16, norm_topk_prob=False,
                                                    decoder_sparse_step=2, attention_bias=True,
                                                    use_sliding_window=True, sliding_window=24,
                                                    tie_word_embeddings=True, architectures=["Qwen3MoeForCausalLM"]),
    # Shared expert behind a sigmoid gate; q/k/v biases; layers 0 and 2 dense.
    "qwen2_moe": lambda: Qwen2MoeConfig(**THREE_LAYERS, **QWEN_EXPERTS, shared_expert_intermediate_size=48,
                                        decoder_sparse_step=2, tie_word_embeddings=False,
                                        architectures=["Qwen2MoeForCausalLM"]),
    "mixtral": lambda: MixtralConfig(**{**TINY_COMMON, "intermediate_size": 48}, num_local_experts=4,
                                     num_experts_per_tok=2, architectures=["MixtralForCausalLM"]),
    # Mistral's window on every layer; top-1 routing (renormalised to weight 1).
    "mixtral_window_top1": lambda: MixtralConfig(**{**TINY_COMMON, "intermediate_size": 48}, num_local_experts=3,
                                                 num_experts_per_tok=1, sliding_window=20,
                                                 architectures=["MixtralForCausalLM"]),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_models")
    return {name: save_tiny_model(make(), root / name) for name, make in CONFIGS.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_model_matches_hf(name, moe_dirs, make_llm):
    check_matches_hf(moe_dirs[name], make_llm)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_moe_model_in_bf16_runs_the_cpu_expert_path(name, moe_dirs, make_llm):
    llm = make_llm(moe_dirs[name], dtype="bfloat16")
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_layers_follow_mlp_only_layers_and_decoder_sparse_step(moe_dirs):
    with LLM(str(moe_dirs["qwen3_moe"]), show_progress=False) as llm:
        assert [type(layer.mlp).__name__ for layer in llm.engine.runner.model.layers] == \
            ["SparseMoeBlock", "GatedMLP", "SparseMoeBlock"]
    with LLM(str(moe_dirs["qwen2_moe"]), show_progress=False) as llm:
        layers = llm.engine.runner.model.layers
        assert [type(layer.mlp).__name__ for layer in layers] == ["GatedMLP", "SparseMoeBlock", "GatedMLP"]
        assert layers[1].mlp.shared_expert is not None


# ------------------------------------------------------------------ weight loading


def build(config):
    model_class = model_class_for(config)
    return model_class(model_class.arch_from_hf_config(config))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_fused_in_memory_experts_load_like_per_expert_hub_tensors(name, moe_dirs):
    """transformers 5 holds experts fused (``experts.gate_up_proj``); hub files one tensor per expert."""
    hf = AutoModelForCausalLM.from_pretrained(moe_dirs[name], dtype=torch.float32)
    assert any(key.endswith("experts.gate_up_proj") for key in hf.state_dict())
    from safetensors.torch import load_file
    hub = load_file(moe_dirs[name] / "model.safetensors")
    assert any(".experts.0." in key for key in hub)
    fused, per_expert = build(hf.config), build(hf.config)
    fused.load_weights(hf.state_dict())
    per_expert.load_weights(hub)
    for (key, a), (_, b) in zip(fused.state_dict().items(), per_expert.state_dict().items()):
        assert torch.equal(a, b), key


def test_expert_checkpoint_names_map_to_stacked_shards(moe_dirs):
    qwen = build(AutoModelForCausalLM.from_pretrained(moe_dirs["qwen3_moe"]).config)
    assert qwen.param_for_checkpoint_name("model.layers.2.mlp.experts.5.up_proj.weight") == \
        ("layers.2.mlp.experts.w13_weight", ExpertShard("up", 5))
    assert qwen.param_for_checkpoint_name("model.layers.0.mlp.experts.down_proj") == \
        ("layers.0.mlp.experts.w2_weight", None)
    mixtral = build(AutoModelForCausalLM.from_pretrained(moe_dirs["mixtral"]).config)
    assert mixtral.param_for_checkpoint_name("model.layers.1.block_sparse_moe.experts.3.w3.weight") == \
        ("layers.1.mlp.experts.w13_weight", ExpertShard("up", 3))
    assert mixtral.param_for_checkpoint_name("model.layers.1.block_sparse_moe.gate.weight") == \
        ("layers.1.mlp.gate.weight", None)


def test_weight_loader_fills_one_experts_slice():
    experts = FusedMoE(num_experts=3, top_k=1, hidden_size=4, intermediate_size=2, renormalize=False)
    experts.w13_weight.data.zero_()
    experts.w13_weight.weight_loader(experts.w13_weight, torch.ones(2, 4), "up", 1)
    assert experts.w13_weight[1, 2:].eq(1).all() and experts.w13_weight[1, :2].eq(0).all()
    assert experts.w13_weight[[0, 2]].eq(0).all()
    experts.w2_weight.weight_loader(experts.w2_weight, torch.full((3, 4, 2), 2.0), "down")  # all experts stacked
    assert experts.w2_weight.eq(2).all()


@pytest.mark.parametrize("tensor,shard_id,expert_id,match", [
    (torch.ones(3, 4), "gate", 0, "shape"),
    (torch.ones(2, 4), "gate", 3, "out of range"),
    (torch.ones(2, 4), "down", 0, "does not load"),
])
def test_weight_loader_refuses_a_tensor_that_does_not_fit(tensor, shard_id, expert_id, match):
    experts = FusedMoE(num_experts=3, top_k=1, hidden_size=4, intermediate_size=2, renormalize=False)
    with pytest.raises(ValueError, match=match):
        experts.w13_weight.weight_loader(experts.w13_weight, tensor, shard_id, expert_id)


def test_check_checkpoint_names_a_wrongly_shaped_expert(moe_dirs):
    from safetensors.torch import load_file
    model = build(AutoModelForCausalLM.from_pretrained(moe_dirs["qwen3_moe"]).config)
    shapes = {name: (tuple(t.shape), "model.safetensors") for name, t in load_file(moe_dirs["qwen3_moe"] /
                                                                                     "model.safetensors").items()}
    model.check_checkpoint(shapes, "model.safetensors")
    shapes["model.layers.0.mlp.experts.4.gate_proj.weight"] = ((31, 64), "model.safetensors")
    with pytest.raises(ValueError, match="experts.4.gate_proj"):
        model.check_checkpoint(shapes, "model.safetensors")
    del shapes["model.layers.0.mlp.experts.4.gate_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        model.check_checkpoint(shapes, "model.safetensors")


# ------------------------------------------------------------------ config honesty


def with_raw_field(config, name, value):
    """A value transformers' own validation would refuse (older transformers read such configs)."""
    config.__dict__[name] = value
    return config


@pytest.mark.parametrize("make_config,field", [
    (lambda: Qwen3MoeConfig(**TINY_COMMON, **QWEN_EXPERTS, hidden_act="gelu"), "hidden_act"),
    (lambda: Qwen3MoeConfig(**TINY_COMMON, **{**QWEN_EXPERTS, "num_experts_per_tok": 9}), "num_experts_per_tok"),
    (lambda: Qwen2MoeConfig(**TINY_COMMON, **QWEN_EXPERTS, decoder_sparse_step=0), "decoder_sparse_step"),
    (lambda: with_raw_field(Qwen2MoeConfig(**TINY_COMMON, **QWEN_EXPERTS), "mlp_only_layers", "all"), "mlp_only_layers"),
    (lambda: MixtralConfig(**TINY_COMMON, num_local_experts=4, num_experts_per_tok=0), "num_experts_per_tok"),
])
def test_unusable_moe_config_fields_are_refused_by_name(make_config, field):
    config = make_config()
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    with pytest.raises(ValueError, match=field):
        model_class_for(config).arch_from_hf_config(config)


def test_training_only_router_fields_are_ignored():
    """Jitter noise (applied by HF in training mode only) and the aux-loss weight change no inference math."""
    config = MixtralConfig(**TINY_COMMON, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1,
                           router_aux_loss_coef=0.5, output_router_logits=True, architectures=["MixtralForCausalLM"])
    arch = model_class_for(config).arch_from_hf_config(config)
    assert arch.norm_topk_prob and arch.num_experts == 4
