"""Config honesty for the Llama family: every math-changing config field either runs as HF runs it
(token-equal greedy, fp32 CPU) or is refused with a ValueError naming the field and value, before
any weight is read."""
from __future__ import annotations

import json
import re

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from hearth_llm.engine import LLM

from conftest import TINY_COMMON
from model_equality import check_alone_and_batched, check_matches_hf, save_tiny_model

LLAMA = dict(TINY_COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def llama(**fields) -> LlamaConfig:
    return LlamaConfig(**{**LLAMA, **fields})


# --- implemented: equal to HF --------------------------------------------------------------------

# One activation per implementation path: the SiLU kernel, the tanh and exact GeLU kernels, and a
# plain-torch one; the remaining HF aliases run the same code as one of these.
ACTIVATIONS_FULL_CHECK = ["gelu_pytorch_tanh", "relu2"]
ACTIVATIONS_QUICK_CHECK = ["gelu", "gelu_new", "quick_gelu", "relu", "gelu_fast"]


@pytest.mark.parametrize("hidden_act", ACTIVATIONS_FULL_CHECK)
def test_llama_hidden_act_matches_hf(hidden_act, tmp_path, make_llm):
    check_matches_hf(save_tiny_model(llama(hidden_act=hidden_act), tmp_path / hidden_act), make_llm)


@pytest.mark.parametrize("hidden_act", ACTIVATIONS_QUICK_CHECK)
def test_other_llama_activations_match_hf(hidden_act, tmp_path, make_llm):
    check_alone_and_batched(save_tiny_model(llama(hidden_act=hidden_act), tmp_path / hidden_act), make_llm)


def test_llama_attention_and_mlp_biases_match_hf(tmp_path, make_llm):
    path = save_tiny_model(llama(attention_bias=True, mlp_bias=True), tmp_path / "biases")
    check_matches_hf(path, make_llm)


@pytest.mark.parametrize("attention_bias, mlp_bias", [(True, False), (False, True)])
def test_llama_one_bias_kind_alone_matches_hf(attention_bias, mlp_bias, tmp_path, make_llm):
    path = save_tiny_model(llama(attention_bias=attention_bias, mlp_bias=mlp_bias), tmp_path / "bias")
    check_alone_and_batched(path, make_llm)


def test_qwen3_with_attention_bias_matches_hf(tmp_path, make_llm):
    config = Qwen3Config(**TINY_COMMON, head_dim=32, attention_bias=True, architectures=["Qwen3ForCausalLM"])
    check_alone_and_batched(save_tiny_model(config, tmp_path / "qwen3-bias"), make_llm)


@pytest.mark.parametrize("config_class, architecture", [(Qwen2Config, "Qwen2ForCausalLM"),
                                                        (Qwen3Config, "Qwen3ForCausalLM")])
def test_explicit_layer_types_choose_the_sliding_layers(config_class, architecture, tmp_path, make_llm):
    # The window is short so it changes the tokens; layer 0 slides, layer 1 does not, the
    # opposite of what max_window_layers alone would give.
    config = config_class(**TINY_COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                          layer_types=["sliding_attention", "full_attention"], architectures=[architecture])
    path = save_tiny_model(config, tmp_path / "layer-types")
    llm = make_llm(path)
    assert [layer.self_attn.sliding_window for layer in llm.engine.runner.model.layers] == [6, None]
    check_matches_hf(path, make_llm)


def test_uniform_layer_types_on_llama_change_nothing_and_match_hf(tmp_path, make_llm):
    path = save_tiny_model(llama(layer_types=["full_attention", "full_attention"]), tmp_path / "uniform")
    check_alone_and_batched(path, make_llm)


def test_mistral_with_mixed_layer_types_is_refused(tmp_path):
    config = MistralConfig(**TINY_COMMON, sliding_window=6, architectures=["MistralForCausalLM"])
    config.layer_types = ["sliding_attention", "full_attention"]
    from hearth_llm.engine.models import model_class_for

    with pytest.raises(ValueError, match="config.json: layer_types=.* is not supported by LlamaForCausalLM"):
        model_class_for(config).arch_from_hf_config(config)


def test_mistral_window_applies_to_every_layer_as_hf_does(tmp_path, make_llm):
    config = MistralConfig(**TINY_COMMON, sliding_window=6, architectures=["MistralForCausalLM"])
    path = save_tiny_model(config, tmp_path / "mistral-window")
    check_alone_and_batched(path, make_llm)


# --- refused: named, before any weight is read -----------------------------------------------------

REFUSED = {
    "hidden_act": (dict(hidden_act="prelu"), "hidden_act='prelu' is not supported by LlamaForCausalLM"),
    "xielu": (dict(hidden_act="xielu"), "hidden_act='xielu' is not supported by LlamaForCausalLM"),
    "longrope": (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                    "original_max_position_embeddings": 256}),
                 "rope_scaling type 'longrope' is not supported by LlamaForCausalLM"),
    "dynamic": (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                "rope_scaling type 'dynamic' is not supported by LlamaForCausalLM"),
    "partial_rotary_factor": (dict(partial_rotary_factor=0.5),
                              "partial_rotary_factor=0.5 is not supported by LlamaForCausalLM"),
    # HF Llama's attention has no window, yet its generation cache would trim keys to one.
    "sliding_window": (dict(sliding_window=6), "sliding_window=6 is not supported by LlamaForCausalLM"),
    "layer_types": (dict(layer_types=["sliding_attention", "full_attention"]),
                    "layer_types=['sliding_attention', 'full_attention'] is not supported by LlamaForCausalLM"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_llama_fields_are_refused_before_weights_are_read(case, tmp_path, monkeypatch):
    from hearth_llm.engine.loader import hf_dir

    fields, message = REFUSED[case]
    path = save_tiny_model(llama(), tmp_path / case)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(fields)
    config_file.write_text(json.dumps(config))

    def no_reads(*args, **kwargs):
        raise AssertionError("weights were read before the config was checked")

    monkeypatch.setattr(hf_dir, "_stream_safetensors", no_reads)
    with pytest.raises(ValueError, match="config.json: " + re.escape(message)):
        LLM(str(path), show_progress=False)
