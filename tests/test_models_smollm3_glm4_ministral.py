"""SmolLM3 (NoPE layers), GLM-4 (post-norms, partial GPT-J rotary, fused gate/up checkpoint) and
Ministral (per-layer sliding window) give HF transformers' greedy tokens (fp32, CPU) in every
scheduling situation of tests/model_equality.py."""
from __future__ import annotations

import pytest
from transformers import Glm4Config, MinistralConfig, SmolLM3Config

from conftest import TINY_COMMON, hf_greedy, random_prompts
from model_equality import CHECKS, TinyModelDirs, save_tiny_model

FOUR_LAYERS = {**TINY_COMMON, "num_hidden_layers": 4}
CONFIGS = {
    # Layers 2 and 4 without rotary.
    "smollm3": lambda: SmolLM3Config(**FOUR_LAYERS, no_rope_layer_interval=2, architectures=["SmolLM3ForCausalLM"]),
    # ... and with a 12-token window on them, biases everywhere.
    "smollm3-window": lambda: SmolLM3Config(**FOUR_LAYERS, no_rope_layer_interval=2, use_sliding_window=True,
                                            sliding_window=12, attention_bias=True, mlp_bias=True,
                                            tie_word_embeddings=False, architectures=["SmolLM3ForCausalLM"]),
    "glm4": lambda: Glm4Config(**TINY_COMMON, head_dim=16, architectures=["Glm4ForCausalLM"]),
    "ministral": lambda: MinistralConfig(**FOUR_LAYERS, head_dim=16, sliding_window=12,
                                         layer_types=["sliding_attention", "full_attention"] * 2,
                                         architectures=["MinistralForCausalLM"]),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return TinyModelDirs(CONFIGS, tmp_path_factory.mktemp)


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_hf(name, check, model_dir, make_llm):
    CHECKS[check](model_dir(name), make_llm)


# Each config with its special feature switched off: HF's tokens must change, so the equality
# checks above cannot pass with the feature ignored.
FEATURE_OFF = {
    "smollm3": lambda: SmolLM3Config(**FOUR_LAYERS, no_rope_layers=[1] * 4, architectures=["SmolLM3ForCausalLM"]),
    "smollm3-window": lambda: SmolLM3Config(**FOUR_LAYERS, no_rope_layer_interval=2, use_sliding_window=False,
                                            attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                                            architectures=["SmolLM3ForCausalLM"]),
    "glm4": lambda: Glm4Config(**TINY_COMMON, head_dim=16, partial_rotary_factor=1.0, architectures=["Glm4ForCausalLM"]),
    "ministral": lambda: MinistralConfig(**FOUR_LAYERS, head_dim=16, sliding_window=12,
                                         layer_types=["full_attention"] * 4, architectures=["MinistralForCausalLM"]),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_special_feature_changes_hf_tokens(name, model_dir, tmp_path):
    without = save_tiny_model(FEATURE_OFF[name](), tmp_path / "off", seed=len(name))
    prompts = random_prompts(2, [29, 40], seed=17)
    assert any(hf_greedy(model_dir(name), p, 16) != hf_greedy(without, p, 16) for p in prompts)
