"""OLMo 2, Granite, Cohere / Command-R and StarCoder2 give HF transformers' greedy tokens (fp32, CPU)
alone, batched, with prefix hits, under forced preemption and with chunked prefill.

Each tiny config sets its family's special fields far from their neutral values, so a missing
feature fails a check: Granite's multipliers, a window smaller than the prompts, biases on every
linear, Command-R+'s per-head q/k LayerNorm. Logit scales do not change a greedy choice, so the
log-probabilities are compared too.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import CohereConfig, GraniteConfig, Olmo2Config, Starcoder2Config

from hearth_llm.engine import SamplingParams

from conftest import TINY_COMMON, hf_model, random_prompts
from model_equality import CHECKS, TinyModelDirs

CONFIGS = {
    "olmo2": lambda: Olmo2Config(**TINY_COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                 architectures=["Olmo2ForCausalLM"]),
    "olmo2-bias": lambda: Olmo2Config(**TINY_COMMON, attention_bias=True, tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 2000.0},
                                      architectures=["Olmo2ForCausalLM"]),
    # attention_multiplier 0.6 instead of head_dim ** -0.5 = 0.25; logits divided by 8.
    "granite": lambda: GraniteConfig(**TINY_COMMON, embedding_multiplier=12.0, residual_multiplier=0.22,
                                     attention_multiplier=0.6, logits_scaling=8.0, tie_word_embeddings=True,
                                     architectures=["GraniteForCausalLM"]),
    "granite-bias": lambda: GraniteConfig(**TINY_COMMON, embedding_multiplier=3.0, residual_multiplier=1.7,
                                          attention_multiplier=0.1, logits_scaling=0.25, attention_bias=True,
                                          mlp_bias=True, tie_word_embeddings=False,
                                          architectures=["GraniteForCausalLM"]),
    "cohere": lambda: CohereConfig(**TINY_COMMON, logit_scale=0.5, layer_norm_eps=1e-5,
                                   architectures=["CohereForCausalLM"]),
    # Command-R+: LayerNorm over each head's queries and keys, one weight row per head.
    "cohere-qk-norm": lambda: CohereConfig(**TINY_COMMON, logit_scale=3.0, use_qk_norm=True, attention_bias=True,
                                           tie_word_embeddings=False, architectures=["CohereForCausalLM"]),
    # A 12-token window: the prompts (up to 70 tokens) and their continuations run far past it.
    "starcoder2": lambda: Starcoder2Config(**TINY_COMMON, sliding_window=12, norm_epsilon=1e-5,
                                           architectures=["Starcoder2ForCausalLM"]),
    "starcoder2-no-bias": lambda: Starcoder2Config(**TINY_COMMON, use_bias=False, tie_word_embeddings=False,
                                                   architectures=["Starcoder2ForCausalLM"]),
}
FAMILY_OF = {name: name.split("-")[0] for name in CONFIGS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The saved tiny model of a config name, built on first use."""
    return TinyModelDirs(CONFIGS, tmp_path_factory.mktemp)


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_hf(name, check, model_dir, make_llm):
    CHECKS[check](model_dir(name), make_llm)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logprobs_match_hf(name, model_dir, make_llm):
    """Top-5 log-probabilities of each generated token equal HF's: catches a missing logit scale."""
    path = model_dir(name)
    llm = make_llm(path)
    prompt = random_prompts(1, [23], seed=21)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = hf_model(str(path))(torch.tensor([prompt + output.token_ids[:-1]])).logits[0]
    expected = torch.log_softmax(logits[len(prompt) - 1:].float(), dim=-1)
    for step, entries in enumerate(output.logprobs):
        for token_id, entry in entries.items():
            assert entry.logprob == pytest.approx(expected[step, token_id].item(), abs=1e-4), (step, token_id)


UNSUPPORTED_ACTIVATION = "laplace"  # a real transformers activation no checkpoint of these families uses


@pytest.mark.parametrize("name", ["olmo2", "granite", "cohere", "starcoder2"])
def test_unsupported_activation_is_refused_by_name(name, model_dir, tmp_path, make_llm):
    path = _copy_with_config(model_dir(name), tmp_path / name, hidden_act=UNSUPPORTED_ACTIVATION)
    with pytest.raises(ValueError, match=f"hidden_act.*{UNSUPPORTED_ACTIVATION}"):
        make_llm(path)


def _copy_with_config(source, target, **changes):
    """A copy of a saved model directory whose config.json has ``changes`` applied."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target
