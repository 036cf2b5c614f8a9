"""On CUDA: OLMo 2, Granite, Cohere (with and without q/k norm), StarCoder2, and the smaller extras
SmolLM3, GLM-4 and Ministral against HF
transformers on random-weight models of a real width. fp32 must be token-equal; bf16 is compared
by the top-5 rule of tests/test_gpu_engine.py (at the first divergence each side's token is in the
other side's top 5). Skipped without a GPU.

Run on the H200: ``HEARTH_GPU_REPORT=gpu.json python -m pytest -q tests/test_gpu_models_olmo_granite_cohere_starcoder.py``
"""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import (CohereConfig, Glm4Config, GraniteConfig, MinistralConfig, Olmo2Config, PreTrainedTokenizerFast,
                          SmolLM3Config, Starcoder2Config)

from test_gpu_engine import NUM_TOKENS, hf_generate, prompts, report

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB = 8192
SHAPE = dict(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=0)
CONFIGS = {
    "olmo2": lambda: Olmo2Config(**SHAPE, architectures=["Olmo2ForCausalLM"]),
    "granite": lambda: GraniteConfig(**SHAPE, embedding_multiplier=12.0, residual_multiplier=0.22,
                                     attention_multiplier=0.0078125, logits_scaling=8.0, tie_word_embeddings=True,
                                     architectures=["GraniteForCausalLM"]),
    "cohere": lambda: CohereConfig(**SHAPE, logit_scale=0.0625, architectures=["CohereForCausalLM"]),
    "cohere-qk-norm": lambda: CohereConfig(**SHAPE, logit_scale=0.0625, use_qk_norm=True,
                                           architectures=["CohereForCausalLM"]),
    "starcoder2": lambda: Starcoder2Config(**SHAPE, sliding_window=64, architectures=["Starcoder2ForCausalLM"]),
    "smollm3": lambda: SmolLM3Config(**SHAPE, no_rope_layer_interval=3, architectures=["SmolLM3ForCausalLM"]),
    "glm4": lambda: Glm4Config(**SHAPE, head_dim=64, architectures=["Glm4ForCausalLM"]),
    "ministral": lambda: MinistralConfig(**SHAPE, head_dim=64, sliding_window=64,
                                         layer_types=["sliding_attention", "full_attention"] * 3,
                                         architectures=["MinistralForCausalLM"]),
}


def random_model_dir(name: str, dtype: torch.dtype, path):
    """An HF model of ``CONFIGS[name]`` on the GPU, saved to ``path`` with an id-only tokenizer.
    Norm weights and biases get noise so that a misplaced or missing one shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t1", pad_token="t0", unk_token="t2").save_pretrained(path)
    return model


def run_ours(path, dtype: str, logprobs: int | None):
    from hearth_llm.engine.config import EngineConfig
    from hearth_llm.engine.llm_engine import LLMEngine
    from hearth_llm.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cuda", max_num_seqs=16,
                                    kv_cache_memory="4GiB", max_model_len=1024, show_progress=False))
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, detokenize=False,
                            logprobs=logprobs)
    batch = prompts(VOCAB)
    ids = [engine.add_request(p, params) for p in batch]
    while engine.has_unfinished_requests():
        engine.step()
    requests = [engine.groups[i][0] for i in ids]
    return batch, requests


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp32_greedy_is_token_equal_to_hf(name, tmp_path):
    model = random_model_dir(name, torch.float32, tmp_path)
    batch, requests = run_ours(tmp_path, "float32", logprobs=None)
    ours = [request.output_token_ids for request in requests]
    with torch.no_grad():
        references = [hf_generate(model, p)[0] for p in batch]
    report(f"{name}/fp32_sequences_equal", f"{sum(a == b for a, b in zip(ours, references))}/{len(batch)}")
    assert ours == references


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bf16_greedy_is_close_to_hf(name, tmp_path):
    model = random_model_dir(name, torch.bfloat16, tmp_path)
    batch, requests = run_ours(tmp_path, "bfloat16", logprobs=5)
    num_identical, num_tokens_before_divergence = 0, 0
    for request, prompt in zip(requests, batch):
        ours, our_tops = request.output_token_ids, [set(entry) for entry in request.logprobs]
        with torch.no_grad():
            theirs, their_tops = hf_generate(model, prompt)
        for step, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                assert a in their_tops[step] and b in our_tops[step], f"step {step}: {a} vs {b}"
                break
            num_tokens_before_divergence += 1
        num_identical += ours == theirs
    report(f"{name}/bf16_sequences_identical", f"{num_identical}/{len(batch)}")
    report(f"{name}/bf16_tokens_before_divergence", f"{num_tokens_before_divergence}/{len(batch) * NUM_TOKENS}")
