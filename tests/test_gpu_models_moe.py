"""On CUDA: the MoE models against HF transformers on random-weight models of real widths (the
Qwen3-30B-A3B and Mixtral-8x7B shapes, a few layers deep so HF and ours fit side by side).
fp32 must be token-equal; in bf16 every first divergence lies inside the other side's top-5, as
tests/test_gpu_engine.py checks the dense models. Skipped without a GPU."""
import pytest
import torch

import test_gpu_engine as gpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# shape -> layers built: full width, shallow (the 48-layer Qwen3-30B-A3B alone is 57 GiB in bf16).
SHAPES = {"qwen3-30b-a3b": 4, "mixtral-8x7b": 2}


def run_ours(shape: str, dtype: torch.dtype, logprobs: int | None):
    from hearth_llm.benchmarks.throughput import our_engine, random_model
    from hearth_llm.engine.sampling_params import SamplingParams

    model, checkpoint = random_model(shape, dtype, "cuda", num_layers=SHAPES[shape])
    engine = our_engine(checkpoint, str(dtype).removeprefix("torch."), max_num_seqs=16, kv_cache_memory="4GiB",
                        max_model_len=1024)
    del checkpoint
    params = SamplingParams(temperature=0, max_tokens=gpu.NUM_TOKENS, ignore_eos=True, detokenize=False,
                            logprobs=logprobs)
    batch = gpu.prompts()
    ids = [engine.add_request(p, params) for p in batch]
    while engine.has_unfinished_requests():
        engine.step()
    return model, batch, [engine.groups[i][0] for i in ids]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_moe_fp32_greedy_is_token_equal_to_hf(shape):
    model, batch, requests = run_ours(shape, torch.float32, None)
    ours = [request.output_token_ids for request in requests]
    with torch.no_grad():
        references = [gpu.hf_generate(model, p)[0] for p in batch]
    gpu.report(f"{shape}/fp32_sequences_equal", f"{sum(a == b for a, b in zip(ours, references))}/{len(batch)}")
    assert ours == references


# Mixtral's random 8-expert top-2 router sits near ties: on the H200 (2026-12-01), HF bf16 against HF bf16
# with only its router matmul in fp32 diverged outside its own top-5 on 2 of the 6 prompts (steps 25 and 30),
# so no bf16 implementation can meet the top-5 rule against HF here; its fp32 run above is token-equal.
# Reproduce: python3 tests/gpu_moe_router_ties.py on a GPU (prints both comparisons per prompt).
_MIXTRAL_ROUTER_TIES = pytest.mark.xfail(
    reason="a random top-2-of-8 router flips experts under bf16 rounding: HF against itself with an fp32 "
           "router leaves its own top-5 too (measured on the H200); fp32 is token-equal", strict=False)
BF16_SHAPES = [pytest.param(s, marks=_MIXTRAL_ROUTER_TIES) if s.startswith("mixtral") else s for s in sorted(SHAPES)]


@pytest.mark.parametrize("shape", BF16_SHAPES)
def test_moe_bf16_greedy_is_close_to_hf(shape):
    model, batch, requests = run_ours(shape, torch.bfloat16, 5)
    num_identical, num_tokens_before_divergence = 0, 0
    for request, prompt in zip(requests, batch):
        ours, our_tops = request.output_token_ids, [set(entry) for entry in request.logprobs]
        with torch.no_grad():
            theirs, their_tops = gpu.hf_generate(model, prompt)
        for step, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                assert a in their_tops[step] and b in our_tops[step], f"step {step}: {a} vs {b}"
                break
            num_tokens_before_divergence += 1
        num_identical += ours == theirs
    gpu.report(f"{shape}/bf16_sequences_identical", f"{num_identical}/{len(batch)}")
    gpu.report(f"{shape}/bf16_tokens_before_divergence", f"{num_tokens_before_divergence}/{len(batch) * gpu.NUM_TOKENS}")
