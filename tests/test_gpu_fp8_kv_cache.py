"""On CUDA: ``kv_cache_dtype="fp8"`` end to end on a random-weight Qwen3-0.6B-shaped model (4 layers):
the cache is e4m3 with twice the blocks of a bf16 cache in the same bytes, and greedy decoding
stays close to the bf16-cache engine (vLLM's check_logprobs_close rule: where the tokens first
differ, each is in the other's top 5). Skipped without a GPU."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NUM_TOKENS = 24


def run(checkpoint, kv_cache_dtype, prompts):
    from hearth_llm.engine.config import EngineConfig
    from hearth_llm.engine.llm_engine import LLMEngine
    from hearth_llm.engine.sampling_params import SamplingParams

    config = EngineConfig(model=checkpoint.source, dtype="bfloat16", device="cuda", max_num_seqs=16,
                          kv_cache_memory="1GiB", max_model_len=1024, show_progress=False,
                          kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(config, checkpoint=checkpoint)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, detokenize=False, logprobs=5)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    requests = [engine.groups[i][0] for i in ids]
    return engine, [(r.output_token_ids, [set(e) for e in r.logprobs]) for r in requests]


def test_fp8_kv_cache_holds_twice_the_blocks_and_decodes_close_to_bf16():
    from hearth_llm.benchmarks.throughput import random_checkpoint

    _, checkpoint = random_checkpoint("qwen3-0.6b", torch.bfloat16, "cuda", num_layers=4)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (n,), generator=generator).tolist() for n in (5, 40, 130, 300)]
    bf16_engine, bf16 = run(checkpoint, "auto", prompts)
    fp8_engine, fp8 = run(checkpoint, "fp8", prompts)
    assert fp8_engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8_engine.runner.num_blocks == 2 * bf16_engine.runner.num_blocks
    same_prefix = 0
    for (ours, our_tops), (theirs, their_tops) in zip(fp8, bf16):
        for step, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                assert a in their_tops[step] and b in our_tops[step], f"step {step}: {a} vs {b}"
                break
            same_prefix += 1
    assert same_prefix >= len(prompts) * 4  # the first tokens agree: the cache is read back, not garbage
