"""On CUDA: the engine against HF transformers on random-weight models of real shapes.
fp32 must be token-equal; bf16 is compared as vLLM's check_logprobs_close does. Skipped without a GPU."""
import json
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = ["qwen3-0.6b", "llama3-8b"]
NUM_TOKENS = 32


def prompts(vocab_limit=10000, count=6):
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 40, 130, 17, 300, 64][:count]
    return [torch.randint(0, vocab_limit, (n,), generator=generator).tolist() for n in lengths]


def hf_generate(model, prompt, top=5):
    input_ids = torch.tensor([prompt], device="cuda")
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NUM_TOKENS,
                         min_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    tops = [set(torch.log_softmax(s[0].float(), -1).topk(top).indices.tolist()) for s in out.scores]
    return tokens, tops


def report(name, value):
    path = os.environ.get("HEARTH_GPU_REPORT")
    if path:
        data = json.load(open(path)) if os.path.exists(path) else {}
        data[name] = value
        json.dump(data, open(path, "w"), indent=2)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_greedy_is_token_equal_to_hf(shape):
    from hearth_llm.benchmarks.throughput import our_engine, random_model
    from hearth_llm.engine.sampling_params import SamplingParams

    model, checkpoint = random_model(shape, torch.float32, "cuda")
    engine = our_engine(checkpoint, "float32", max_num_seqs=16, kv_cache_memory="4GiB", max_model_len=1024)
    del checkpoint
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, detokenize=False)
    batch = prompts()
    ids = [engine.add_request(p, params) for p in batch]
    while engine.has_unfinished_requests():
        engine.step()
    ours = [engine.groups[i][0].output_token_ids for i in ids]
    with torch.no_grad():
        references = [hf_generate(model, p)[0] for p in batch]
    matches = sum(a == b for a, b in zip(ours, references))
    report(f"{shape}/fp32_sequences_equal", f"{matches}/{len(batch)}")
    assert ours == references


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_greedy_is_close_to_hf(shape):
    from hearth_llm.benchmarks.throughput import our_engine, random_model
    from hearth_llm.engine.sampling_params import SamplingParams

    model, checkpoint = random_model(shape, torch.bfloat16, "cuda")
    engine = our_engine(checkpoint, "bfloat16", max_num_seqs=16, kv_cache_memory="4GiB", max_model_len=1024)
    del checkpoint
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, detokenize=False, logprobs=5)
    batch = prompts()
    ids = [engine.add_request(p, params) for p in batch]
    while engine.has_unfinished_requests():
        engine.step()
    num_identical, num_tokens_before_divergence = 0, 0
    for request_id, prompt in zip(ids, batch):
        request = engine.groups[request_id][0]
        ours, our_tops = request.output_token_ids, [set(entry) for entry in request.logprobs]
        with torch.no_grad():
            theirs, their_tops = hf_generate(model, prompt)
        for step, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                assert a in their_tops[step] and b in our_tops[step], f"step {step}: {a} vs {b}"
                break
            num_tokens_before_divergence += 1
        num_identical += ours == theirs
    report(f"{shape}/bf16_sequences_identical", f"{num_identical}/{len(batch)}")
    report(f"{shape}/bf16_tokens_before_divergence", f"{num_tokens_before_divergence}/{len(batch) * NUM_TOKENS}")
