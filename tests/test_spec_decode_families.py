"""Speculative greedy decoding equals HF transformers on the other model families: windows, soft
caps, local/global layers, no-rope layers, q/k norms, parallel blocks, MoE (llama runs every
harness check in test_spec_decode.py). Each verification step accepts some proposals and rejects
the rest, so both the accepted KV and the rolled-back positions are exercised in every family."""
from __future__ import annotations

import pytest

import test_models_gemma_phi as gemma_phi
import test_models_moe as moe
import test_models_olmo_granite_cohere_starcoder as olmo_etc
import test_models_smollm3_glm4_ministral as smollm3_etc
from hearth_llm.engine import SamplingParams

from conftest import TINY_CONFIGS, TINY_VOCAB, hf_greedy, random_prompts
from model_equality import save_tiny_model

MAX_TOKENS = 12
FAMILIES = {
    "mistral": TINY_CONFIGS["mistral"],
    "qwen3": TINY_CONFIGS["qwen3"],
    "gemma2": lambda: gemma_phi.make_config("gemma2"),
    "gemma3": lambda: gemma_phi.make_config("gemma3"),
    "phi3-window": lambda: gemma_phi.make_config("phi3-window"),
    "qwen3_moe": moe.CONFIGS["qwen3_moe"],
    "cohere": olmo_etc.CONFIGS["cohere"],
    "starcoder2": olmo_etc.CONFIGS["starcoder2"],
    "smollm3-window": smollm3_etc.CONFIGS["smollm3-window"],
}


class HalfRightProposer:
    """Proposes the reference continuation with every third token wrong: a verify step accepts
    the first two proposals, draws the third itself, and rolls the fourth back."""

    def __init__(self, references: dict[tuple, list[int]]) -> None:
        self.references = references

    def propose(self, requests, max_num_tokens: list[int]) -> list[list[int]]:
        proposals = []
        for request, room in zip(requests, max_num_tokens):
            prompt = tuple(request.token_ids[:request.num_prompt_tokens])
            done = len(request.token_ids) - len(prompt)
            right = self.references[prompt][done:done + room]
            proposals.append([(t + 1) % TINY_VOCAB if i % 3 == 2 else t for i, t in enumerate(right)])
        return proposals

    def forget_finished(self) -> None:
        pass


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_speculative_greedy_matches_hf_batched(family, tmp_path, make_engine):
    path = save_tiny_model(FAMILIES[family](), tmp_path / family)
    prompts = random_prompts(3, [13, 4, 21], seed=45)
    references = {tuple(p): hf_greedy(path, p, MAX_TOKENS) for p in prompts}
    engine = make_engine(path, dtype="float32", block_size=4, kv_cache_memory="4MiB",
                         speculative={"method": "ngram", "num_speculative_tokens": 4})
    engine.proposer = HalfRightProposer(references)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request.request_id, []).extend(delta.new_token_ids)
    assert [tokens[i] for i in ids] == [references[tuple(p)] for p in prompts]
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
