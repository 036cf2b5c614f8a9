"""Speculative decoding: greedy output token-for-token equal to HF transformers (ngram and draft
model, through the shared HF-equality checks), stops inside an accepted run, logprobs, the KV
rollback and prefix cache, the per-request switch, the config's refusals, and a chi-square test
that sampling keeps the target's distribution (with a control that a wrong rule fails it)."""
from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from hearth_llm.engine import EngineConfig, SamplingParams
from hearth_llm.engine import llm_engine
from hearth_llm.engine.block_pool import hash_block_tokens

from conftest import hf_greedy, hf_model, random_prompts, tiny_tokenizer
from model_equality import CHECKS

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Small KV pools: the default 1 GiB is ~10^5 blocks of a tiny model, slow to set up (twice with a draft).
SMALL_POOL = "4MiB"
# float32 everywhere: the reference is float32 HF, and on CUDA "auto" would pick bfloat16.
FP32 = "float32"


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    """The target with its weights nudged: it agrees with the target on about half of its proposals,
    so verification both accepts and rejects."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.005)
    path = tmp_path_factory.mktemp("spec_draft")
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def draft_config(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, "kv_cache_memory": SMALL_POOL}


# ---- greedy exactness ---------------------------------------------------------------------------

def _pool_for(check: str) -> dict:
    return {} if check == "forced_preemption" else {"kv_cache_memory": SMALL_POOL}  # that one sizes its own


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_ngram_greedy_matches_hf(check, target, make_llm):
    CHECKS[check](target, make_llm, dtype=FP32, speculative=NGRAM, **_pool_for(check))


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_draft_model_greedy_matches_hf(check, target, draft, make_llm):
    CHECKS[check](target, make_llm, dtype=FP32, speculative=draft_config(draft), **_pool_for(check))


def test_draft_proposals_are_both_accepted_and_rejected(target, draft, make_llm):
    llm = make_llm(target, dtype=FP32, kv_cache_memory=SMALL_POOL, speculative=draft_config(draft))
    llm.generate(random_prompts(8, [3, 50, 17, 9], seed=12), GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert 0.2 < stats["spec_decode_acceptance_rate"] < 0.95, stats
    per_position = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert per_position == sorted(per_position, reverse=True) and sum(per_position) == stats[
        "spec_decode_num_accepted_tokens"]
    assert math.isclose(stats["spec_decode_mean_acceptance_length"],
                        1 + stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_drafts"])


def test_mixed_speculative_and_plain_requests_match_hf(target, draft, make_llm):
    llm = make_llm(target, dtype=FP32, kv_cache_memory=SMALL_POOL, speculative=draft_config(draft))
    prompts = random_prompts(6, [20, 7, 33], seed=21)
    off = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, speculative=False)
    outputs = llm.generate(prompts, [GREEDY, off] * 3, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(target, prompt, 16)
    num_drafts = llm.stats()["spec_decode_num_drafts"]
    llm.generate(prompts, off, use_tqdm=False)
    assert llm.stats()["spec_decode_num_drafts"] == num_drafts > 0  # switched off: nothing proposed


# ---- stops and logprobs inside an accepted run ------------------------------------------------

@pytest.fixture(scope="module")
def self_drafted(target):
    """The target as its own draft: every greedy proposal is accepted, so each step yields k + 1
    tokens and any stop lands inside an accepted run."""
    return draft_config(target, k=4)


def _stop_variants(plain_tokens: list[int], plain_text: str) -> list[SamplingParams]:
    stop_word = plain_text.split()[6]
    return [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[plain_tokens[8]]),
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_word]),
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_word],
                           include_stop_str_in_output=True)]


def test_stops_inside_an_accepted_run_are_honoured_exactly(target, self_drafted, make_llm):
    prompt = random_prompts(1, [12], seed=31)[0]
    plain_llm = make_llm(target, dtype=FP32, kv_cache_memory=SMALL_POOL)
    plain = plain_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    llm = make_llm(target, dtype=FP32, kv_cache_memory=SMALL_POOL, speculative=self_drafted)
    for params in _stop_variants(plain.token_ids, plain.text):
        expected = plain_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (expected.token_ids, expected.text, expected.finish_reason, expected.stop_reason), params
        assert len(got.token_ids) < 30
    stats = llm.stats()
    assert stats["spec_decode_acceptance_rate"] == 1.0 and stats["spec_decode_num_drafts"] > 0


def test_logprobs_of_accepted_tokens_are_the_targets(target, self_drafted, make_llm):
    prompts = random_prompts(2, [12, 5], seed=32)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    plain = make_llm(target, dtype=FP32, kv_cache_memory=SMALL_POOL)
    speculating = make_llm(target, dtype=FP32, kv_cache_memory=SMALL_POOL, speculative=self_drafted)
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = speculating.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        for want_entry, have_entry in zip(want.outputs[0].logprobs, have.outputs[0].logprobs, strict=True):
            assert want_entry.keys() == have_entry.keys()
            for token in want_entry:
                assert math.isclose(want_entry[token].logprob, have_entry[token].logprob, abs_tol=1e-4)
                assert want_entry[token].rank == have_entry[token].rank


# ---- KV rollback and the prefix cache --------------------------------------------------------

def test_rejected_kv_is_freed_and_only_accepted_tokens_are_hashed(target, draft, make_engine):
    engine = make_engine(target, dtype=FP32, speculative=draft_config(draft), block_size=4, kv_cache_memory=SMALL_POOL)
    prompts = random_prompts(3, [9, 14, 5], seed=41)
    for prompt in prompts:
        engine.add_request(prompt, GREEDY)
    pool, block_size = engine.kv_cache.pool, engine.kv_cache.block_size
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            assert len(request.block_ids) == -(-request.num_computed_tokens // block_size)
            parent = None
            for index, block_id in enumerate(request.block_ids):
                tokens = request.token_ids[index * block_size:(index + 1) * block_size]
                parent = hash_block_tokens(parent, tokens) if len(tokens) == block_size else None
                block_hash = pool.blocks[block_id].block_hash
                assert block_hash is None or block_hash == parent
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0


def test_a_prompt_extending_a_speculated_answer_reuses_its_blocks(target, draft, make_llm):
    llm = make_llm(target, dtype=FP32, speculative=draft_config(draft), block_size=4, kv_cache_memory=SMALL_POOL)
    prompt = random_prompts(1, [10], seed=42)[0]
    answer = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    follow_up = prompt + answer + [7, 8, 9]
    output = llm.generate([follow_up], GREEDY, use_tqdm=False)[0]
    assert output.num_cached_tokens >= (len(prompt) + len(answer)) // 4 * 4 - 4
    assert output.outputs[0].token_ids == hf_greedy(target, follow_up, 16)


# ---- config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, field", [
    ({"method": "eagle"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "ngram", "model": "x"}, "model"),
    ({"method": "draft_model"}, "model"),
    ({"method": "draft_model", "model": "x", "prompt_lookup_max": 3}, "prompt_lookup"),
    ({"method": "ngram", "lookahead": 3}, "lookahead"),
])
def test_bad_speculative_configs_are_refused_by_name(spec, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative=spec)


def test_async_scheduling_with_speculation_is_refused():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(speculative=NGRAM, async_scheduling=True)
    assert EngineConfig(speculative=NGRAM).speculative.prompt_lookup_max == 3


def test_the_per_request_switch_must_be_a_bool():
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")


# ---- sampling keeps the target's distribution ------------------------------------------------

SMALL_VOCAB = 16
PATTERN = list(range(SMALL_VOCAB)) * 2  # every token occurs in it: the n-gram lookup always proposes


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A one-layer Llama over 16 tokens with soft logits, so every token has a real probability."""
    config = LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["LlamaForCausalLM"])
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
    path = tmp_path_factory.mktemp("small_vocab")
    model.save_pretrained(path)
    backend = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(SMALL_VOCAB)}, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w1", eos_token="w2", pad_token="w0",
                            unk_token="w3").save_pretrained(path)
    return path


def _exact_marginals(path) -> tuple[torch.Tensor, torch.Tensor]:
    """P(second token) and P(third token) after PATTERN, summed over the paths to them."""
    model = hf_model(str(path))
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PATTERN])).logits[0, -1], -1)
        ones = torch.tensor([PATTERN + [t] for t in range(SMALL_VOCAB)])
        second_given = torch.softmax(model(ones).logits[:, -1], -1)                       # [t1, t2]
        twos = torch.tensor([PATTERN + [a, b] for a in range(SMALL_VOCAB) for b in range(SMALL_VOCAB)])
        third_given = torch.softmax(model(twos).logits[:, -1], -1).view(SMALL_VOCAB, SMALL_VOCAB, -1)
    joint_12 = first[:, None] * second_given
    return joint_12.sum(0), (joint_12[:, :, None] * third_given).sum((0, 1))


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test, cells with fewer than 5 expected draws pooled into one."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    statistic = ((observed - expected) ** 2 / expected.clamp_min(1e-12)).sum()
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2.0, dtype=torch.double),
                                         statistic / 2))


def _sample_marginals(llm) -> tuple[torch.Tensor, torch.Tensor]:
    # One request per draw (not n=64): each its own seed, so the draws are fixed and independent.
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=seed) for seed in range(2400)]
    outputs = llm.generate([PATTERN] * len(params), params, use_tqdm=False)
    tokens = torch.tensor([output.outputs[0].token_ids for output in outputs])
    return (torch.bincount(tokens[:, 1], minlength=SMALL_VOCAB), torch.bincount(tokens[:, 2], minlength=SMALL_VOCAB))


def test_rejection_sampling_keeps_the_target_distribution(small_vocab_model, make_llm, monkeypatch):
    second, third = _exact_marginals(small_vocab_model)
    llm = make_llm(small_vocab_model, dtype=FP32, max_num_seqs=256, kv_cache_memory=SMALL_POOL, speculative=NGRAM)
    counts_2, counts_3 = _sample_marginals(llm)
    stats = llm.stats()
    assert stats["spec_decode_num_drafts"] > 2000 and 0.02 < stats["spec_decode_acceptance_rate"] < 0.98, stats
    assert _chi_square_p_value(counts_2, second) > 1e-3
    assert _chi_square_p_value(counts_3, third) > 1e-3
    # The control: a rule that keeps every proposal is caught by the same test on as many draws.
    monkeypatch.setattr(llm_engine, "accepted_tokens", lambda proposals, drawn: proposals + drawn[len(proposals):])
    biased = make_llm(small_vocab_model, dtype=FP32, max_num_seqs=256, kv_cache_memory=SMALL_POOL, speculative=NGRAM)
    biased_2, biased_3 = _sample_marginals(biased)
    assert min(_chi_square_p_value(biased_2, second), _chi_square_p_value(biased_3, third)) < 1e-3
