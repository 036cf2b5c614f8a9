"""Greedy outputs are token-for-token those of HF transformers (fp32, CPU), in every scheduling situation."""
import pytest

from hearth_llm.engine import SamplingParams

from conftest import TINY_CONFIGS, hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ARCHS = sorted(TINY_CONFIGS)


def assert_matches_hf(path, prompts, outputs, max_tokens=24):
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(path, prompt, max_tokens), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch", ARCHS)
def test_each_prompt_alone_matches_hf(arch, tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs[arch])
    for prompt in random_prompts(3, [1, 7, 40], seed=1):
        assert_matches_hf(tiny_model_dirs[arch], [prompt], llm.generate([prompt], GREEDY, use_tqdm=False))


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_16_mixed_lengths_matches_hf(arch, tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs[arch])
    prompts = random_prompts(16, [3, 50, 17, 120, 1, 33, 64, 9], seed=2)
    assert_matches_hf(tiny_model_dirs[arch], prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_requests_added_while_others_decode_match_hf(tiny_model_dirs, make_engine):
    path = tiny_model_dirs["llama"]
    engine = make_engine(path)
    prompts = random_prompts(6, [20, 5, 44], seed=3)
    ids = [engine.add_request(prompts[0], GREEDY)]
    for prompt in prompts[1:]:
        for _ in range(3):
            engine.step()
        ids.append(engine.add_request(prompt, GREEDY))
    while engine.has_unfinished_requests():
        engine.step()
    for request_id, prompt in zip(ids, prompts):
        assert engine.groups[request_id][0].output_token_ids == hf_greedy(path, prompt, 24)
        engine.release(request_id)


def test_shared_prefix_requests_hit_the_cache_and_match_hf(tiny_model_dirs, make_llm):
    path = tiny_model_dirs["qwen2"]
    llm = make_llm(path, block_size=8)
    prefix = random_prompts(1, [40], seed=4)[0]
    suffixes = random_prompts(4, [3, 11, 1, 8], seed=5)
    first = llm.generate([prefix + suffixes[0]], GREEDY, use_tqdm=False)
    rest = llm.generate([prefix + s for s in suffixes[1:]], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert all(out.num_cached_tokens == 40 for out in rest)
    assert llm.stats()["prefix_cache_hits"] >= 3 * 40
    assert_matches_hf(path, [prefix + s for s in suffixes], first + rest)


def test_repeated_prompt_recomputes_only_its_last_token(tiny_model_dirs, make_llm):
    path = tiny_model_dirs["llama"]
    llm = make_llm(path, block_size=4)
    prompt = random_prompts(1, [16], seed=6)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 12  # 16 tokens, the last block holds the token to recompute
    assert_matches_hf(path, [prompt], [again])


def test_forced_preemption_matches_hf(tiny_model_dirs, make_llm):
    path = tiny_model_dirs["mistral"]
    # 2 layers * 2 (k, v) * 4 tokens * 2 heads * 16 dims * 4 bytes = 2 KiB per block; 24 blocks = 96 tokens.
    llm = make_llm(path, block_size=4, kv_cache_memory=24 * 2048, max_model_len=96)
    prompts = random_prompts(8, [30, 12, 25, 40], seed=7)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert_matches_hf(path, prompts, outputs)


def test_chunked_prefill_matches_hf(tiny_model_dirs, make_llm):
    path = tiny_model_dirs["qwen3"]
    llm = make_llm(path, max_num_batched_tokens=16)
    prompts = random_prompts(5, [70, 5, 33], seed=8)
    assert_matches_hf(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_prefix_cache_off_still_matches_hf(tiny_model_dirs, make_llm):
    path = tiny_model_dirs["llama"]
    llm = make_llm(path, enable_prefix_caching=False, block_size=8)
    prompt = random_prompts(1, [30], seed=9)[0]
    outs = llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert_matches_hf(path, [prompt, prompt], outs)
