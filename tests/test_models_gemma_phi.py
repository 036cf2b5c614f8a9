"""Gemma, Gemma 2, Gemma 3 (text) and Phi-3 / Phi-3.5 / Phi-4-mini against HF transformers.

Each tiny config sets its family's special fields to values that change greedy tokens (checked by
``test_each_special_field_changes_hf_tokens``), so a feature our model lacks fails the equality
tests: soft caps small enough to bite, sliding windows shorter than the prompts mixed with full
layers, local/global rope bases with linear scaling on the global layers, a query scale that is not
``head_dim ** -0.5``, partial rotary, and longrope with prompts on both sides of
``original_max_position_embeddings`` (and decodes that cross it).
"""
from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig, Phi3Config

from hearth_llm.engine import SamplingParams

from conftest import TINY_COMMON, hf_greedy, hf_model, random_prompts
from model_equality import CHECKS, GREEDY, MAX_TOKENS, check_alone_and_batched, save_tiny_model

THREE_LAYERS = {**TINY_COMMON, "num_hidden_layers": 3, "head_dim": 16}
SLIDING, FULL = "sliding_attention", "full_attention"
LONGROPE_ORIGINAL_LENGTH = 32  # the harness's prompts run from 1 to 70 tokens, decodes 16 more

CONFIGS = {
    # Gemma 1: `1 + w` norms, sqrt(hidden) embedding scale, GeGLU (gelu tanh), tied head.
    "gemma": (GemmaConfig, dict(TINY_COMMON, head_dim=16, architectures=["GemmaForCausalLM"])),
    # Gemma 2: both soft caps, post-attention / pre- and post-feed-forward norms, a window of 8 on
    # alternate layers, queries scaled by 64 ** -0.5 rather than 16 ** -0.5.
    "gemma2": (Gemma2Config, dict(
        THREE_LAYERS, sliding_window=8, layer_types=[SLIDING, FULL, SLIDING], query_pre_attn_scalar=64,
        attn_logit_softcapping=3.0, final_logit_softcapping=2.0, architectures=["Gemma2ForCausalLM"])),
    # Gemma 3: q/k norm, rope base 1e4 on local layers and 1e6 with linear scaling 4 on the global one.
    "gemma3": (Gemma3TextConfig, dict(
        THREE_LAYERS, sliding_window=8, layer_types=[SLIDING, FULL, SLIDING], query_pre_attn_scalar=64,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                         FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
        architectures=["Gemma3ForCausalLM"])),
    # Phi-3.5-mini style: longrope (short/long factors), half of each head rotated, untied head.
    "phi3-longrope": (Phi3Config, dict(
        TINY_COMMON, original_max_position_embeddings=LONGROPE_ORIGINAL_LENGTH, partial_rotary_factor=0.5,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                      "long_factor": [2.0, 4.0, 8.0, 16.0]},
        architectures=["Phi3ForCausalLM"])),
    # Phi-3-mini-4k / Phi-4-mini style: a window on every layer, 3/4 of each head rotated, tied head.
    "phi3-window": (Phi3Config, dict(
        TINY_COMMON, sliding_window=12, partial_rotary_factor=0.75, tie_word_embeddings=True,
        architectures=["Phi3ForCausalLM"])),
}

# For each config, fields that must matter: HF's tokens change when one is set back to a plain value.
PLAIN_VALUES = {
    "gemma2": [{"attn_logit_softcapping": None}, {"query_pre_attn_scalar": 16}, {"layer_types": [FULL] * 3}],
    "gemma3": [{"query_pre_attn_scalar": 16}, {"layer_types": [FULL] * 3},
               {"rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                    FULL: {"rope_type": "default", "rope_theta": 10000.0}}}],
    "phi3-longrope": [{"rope_scaling": None},
                      {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                        "long_factor": [1.0, 1.5, 2.0, 3.0]}}],
    "phi3-window": [{"sliding_window": None}, {"partial_rotary_factor": 1.0}],
}


def make_config(name: str, **overrides):
    config_class, fields = CONFIGS[name]
    return config_class(**{**fields, **overrides})


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma_phi")
    return {name: save_tiny_model(make_config(name), root / name) for name in CONFIGS}


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_hf(name, check, model_dirs, make_llm):
    CHECKS[check](model_dirs[name], make_llm)


@pytest.mark.parametrize("name, plain", [(name, plain) for name, plains in PLAIN_VALUES.items() for plain in plains],
                         ids=lambda value: value if isinstance(value, str) else ",".join(value))
def test_each_special_field_changes_hf_tokens(name, plain, tmp_path):
    """The equality tests can only catch a missing feature whose absence changes HF's tokens."""
    special = save_tiny_model(make_config(name), tmp_path / "special")
    without = save_tiny_model(make_config(name, **plain), tmp_path / "plain")
    prompts = random_prompts(3, [70, 40, 29], seed=16)
    assert any(hf_greedy(special, p, MAX_TOKENS) != hf_greedy(without, p, MAX_TOKENS) for p in prompts)


@pytest.mark.parametrize("name", ["gemma", "gemma3"])
def test_attention_bias_matches_hf(name, tmp_path, make_llm):
    """Gemma's ``attention_bias`` puts biases on q, k, v and o (no released checkpoint sets it)."""
    check_alone_and_batched(save_tiny_model(make_config(name, attention_bias=True), tmp_path / name), make_llm)


def test_gemma2_logprobs_follow_the_final_soft_cap(model_dirs, make_llm):
    """A final soft cap keeps the argmax, so only the log-probabilities show it."""
    path = model_dirs["gemma2"]
    prompt = random_prompts(1, [20], seed=21)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    output = make_llm(path).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        generated = hf_model(str(path)).generate(
            torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False, eos_token_id=None,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert output.token_ids == generated.sequences[0, len(prompt):].tolist()
    for ours, logits in zip(output.logprobs, generated.logits):
        theirs = torch.log_softmax(logits[0].float(), dim=-1)
        for token_id, logprob in ours.items():
            assert abs(_value(logprob) - theirs[token_id].item()) < 1e-4


def _value(logprob) -> float:
    return logprob if isinstance(logprob, float) else logprob.logprob


def test_longrope_prompts_of_different_regimes_do_not_share_cached_blocks(model_dirs, make_llm):
    """HF picks longrope's long factors for every token of a sequence longer than the original
    context, so a shared prefix has other keys in a long prompt than in a short one: the long prompt
    must not reuse the short one's blocks, while a second short prompt does."""
    path = model_dirs["phi3-longrope"]
    llm = make_llm(path, block_size=8)
    few = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prefix = random_prompts(1, [24], seed=22)[0]
    short_first, short_again, long = prefix + [5], prefix + [6, 7], prefix + random_prompts(1, [20], seed=23)[0]
    assert len(short_again) + few.max_tokens <= LONGROPE_ORIGINAL_LENGTH < len(long)
    outputs = [llm.generate([prompt], few, use_tqdm=False)[0] for prompt in (short_first, long, short_again)]
    assert [out.num_cached_tokens for out in outputs] == [0, 0, 24]
    for prompt, output in zip((short_first, long, short_again), outputs):
        assert output.outputs[0].token_ids == hf_greedy(path, prompt, few.max_tokens)


def test_longrope_sequence_growing_past_the_original_context_is_recomputed_in_the_long_regime(model_dirs, make_llm):
    """HF's generate recomputes a sequence with the long factors once it outgrows the original
    context; ours does too (not counted as a preemption), and its recomputed blocks serve long prompts."""
    path = model_dirs["phi3-longrope"]
    llm = make_llm(path, block_size=8)
    prefix = random_prompts(1, [24], seed=25)[0]
    grows, long = prefix + [5], prefix + random_prompts(1, [20], seed=26)[0]
    assert len(grows) <= LONGROPE_ORIGINAL_LENGTH < len(grows) + MAX_TOKENS
    outputs = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in (grows, long)]
    assert outputs[1].num_cached_tokens == 24
    assert llm.stats()["num_preemptions"] == 0
    for prompt, output in zip((grows, long), outputs):
        assert output.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS)


def test_longrope_long_prompts_share_cached_blocks(model_dirs, make_llm):
    path = model_dirs["phi3-longrope"]
    llm = make_llm(path, block_size=8)
    prefix = random_prompts(1, [40], seed=24)[0]
    first, second = (llm.generate([prefix + [token]], GREEDY, use_tqdm=False)[0] for token in (5, 6))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 40)
    assert second.outputs[0].token_ids == hf_greedy(path, prefix + [6], MAX_TOKENS)


# --- config honesty ------------------------------------------------------------------------------

UNSUPPORTED = {
    "gemma3-attention-soft-cap": ("gemma3", {"attn_logit_softcapping": 20.0}, "attn_logit_softcapping"),
    "gemma2-bidirectional": ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    "gemma-laplace": ("gemma", {"hidden_act": "laplace"}, "hidden_act"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_config_field_is_refused_by_name(case, tmp_path, make_llm):
    name, overrides, field = UNSUPPORTED[case]
    path = save_tiny_model(make_config(name, **overrides), tmp_path / case)
    with pytest.raises(ValueError, match=field):
        make_llm(path)


def test_longrope_recompute_past_the_original_context_under_async_scheduling(model_dirs, make_llm):
    """With async scheduling (CUDA's default) a sequence outgrows L while its next token is still
    in flight; it is recomputed once that token is known, and the tokens stay HF's."""
    path = model_dirs["phi3-longrope"]
    llm = make_llm(path, block_size=8, async_scheduling=True)
    prompts = random_prompts(4, [29, 31, 12, 40], seed=27)
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert output.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
