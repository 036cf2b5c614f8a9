"""Sampling: seeds, filters, penalties, stop conditions, n > 1, logprobs."""
import math

import pytest
import torch

from hearth_llm.engine import SamplingParams

from conftest import hf_model, random_prompts

PROMPTS = random_prompts(6, [5, 12, 30], seed=11)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"])
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(PROMPTS, [seeded] + [others] * 5, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    unseeded_runs = {tuple(o.outputs[0].token_ids) for o in batch[1:]}
    assert len(unseeded_runs) > 1


def test_different_seeds_give_different_samples(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"])
    runs = [llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids for s in range(4)]
    assert len({tuple(r) for r in runs}) > 1


def test_top_k_one_is_greedy(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["qwen2"])
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_tiny_top_p_and_high_min_p_are_greedy(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["qwen2"])
    greedy = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for params in (SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, ignore_eos=True)):
        outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy]


def test_sampled_tokens_stay_inside_top_k(tiny_model_dirs, make_llm):
    path = tiny_model_dirs["llama"]
    llm = make_llm(path)
    prompt = PROMPTS[2]
    with torch.no_grad():
        logits = hf_model(str(path))(torch.tensor([prompt])).logits[0, -1]
    allowed = set(logits.topk(3).indices.tolist())
    params = [SamplingParams(temperature=2.0, top_k=3, max_tokens=1, seed=s) for s in range(40)]
    firsts = {o.outputs[0].token_ids[0] for o in llm.generate([prompt] * 40, params, use_tqdm=False)}
    assert firsts <= allowed and len(firsts) > 1


def test_repetition_penalty_discourages_repeats(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"])
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    penalized = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                     repetition_penalty=5.0, frequency_penalty=2.0),
                             use_tqdm=False)
    distinct = lambda outs: sum(len(set(o.outputs[0].token_ids)) for o in outs)  # noqa: E731
    assert distinct(penalized) > distinct(plain)


def test_n_samples_share_the_prompt_blocks(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], block_size=4)
    prompt = random_prompts(1, [33], seed=12)[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert llm.stats()["prefix_cache_hits"] >= 2 * 32


def test_max_tokens_ends_with_length(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"])
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ids_end_generation_and_min_tokens_delays_them(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"])
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = free[3]
    first = free.index(stop_id)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    delayed = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id],
                                                        min_tokens=first + 2), use_tqdm=False)[0].outputs[0]
    assert stop_id not in delayed.token_ids[: first + 2]


def test_logprobs_match_hf_log_softmax(tiny_model_dirs, make_llm):
    path = tiny_model_dirs["qwen3"]
    llm = make_llm(path)
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=5, prompt_logprobs=2,
                                                ignore_eos=True), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_model(str(path))(torch.tensor([prompt + tokens])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for step, entry in enumerate(out.outputs[0].logprobs):
        row = reference[len(prompt) - 1 + step]
        assert tokens[step] in entry and entry[tokens[step]].rank == 1
        for token_id, logprob in entry.items():
            assert math.isclose(logprob.logprob, row[token_id].item(), abs_tol=1e-4)
        assert len(entry) == 5
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = prompt[position]
        assert math.isclose(entry[token].logprob, reference[position - 1, token].item(), abs_tol=1e-4)


def test_stop_strings_match_across_token_boundaries(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert full.text == "The capital of France is Paris."
    # "of Fr" spans the tokens " of" and " France".
    cut = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=20, stop=["of Fr"]), use_tqdm=False)[0]
    assert cut.outputs[0].text == "The capital "
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == "of Fr"
    kept = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=20, stop=["of Fr"],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == "The capital of Fr"


def test_default_model_greedy_answer_and_eos(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
