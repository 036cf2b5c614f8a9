"""Speculative decoding's Prometheus counters under vLLM's names (``vllm:spec_decode_*``, the
per-position one labelled ``position``), following the engine's own counts, and in /metrics."""
from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest

from hearth_llm.engine import SamplingParams

from conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
K = 3


def _sample(name: str, model, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"model_name": str(model), **labels}) or 0.0


def _counters(model) -> list[float]:
    names = ["drafts", "draft_tokens", "accepted_tokens"]
    values = [_sample(f"vllm:spec_decode_num_{name}_total", model) for name in names]
    return values + [_sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", model, position=str(position))
                     for position in range(K)]


def _engine_counts(stats: dict) -> list[float]:
    return [stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"], *stats["spec_decode_num_accepted_tokens_per_pos"]]


def _self_draft(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": K, "kv_cache_memory": "4MiB"}


def test_spec_decode_counters_follow_each_engine(tiny_model_dirs, make_llm):
    path = tiny_model_dirs["llama"]
    before = _counters(path)
    first = make_llm(path, dtype="float32", kv_cache_memory="4MiB", speculative=_self_draft(path))
    first.generate(random_prompts(2, [9, 14], seed=3), GREEDY, use_tqdm=False)
    first_counts = _engine_counts(first.stats())
    assert first_counts[0] > 0 and first_counts[2] == first_counts[1]  # the target drafting for itself: all kept
    assert [a - b for a, b in zip(_counters(path), before)] == first_counts
    # a second engine serving the same model name adds its own (smaller) counts to the shared counters
    # (another KV pool size: LLMs of the same config share one engine)
    second = make_llm(path, dtype="float32", kv_cache_memory="8MiB", speculative=_self_draft(path))
    second.generate(random_prompts(1, [6], seed=4), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                    use_tqdm=False)
    second_counts = _engine_counts(second.stats())
    assert second_counts[0] > 0
    assert [a - b for a, b in zip(_counters(path), before)] == [a + b for a, b in zip(first_counts, second_counts)]


def test_spec_decode_counters_are_in_the_exposition(tiny_model_dirs, make_llm):
    path = tiny_model_dirs["llama"]
    llm = make_llm(path, dtype="float32", kv_cache_memory="4MiB", speculative=_self_draft(path))
    llm.generate(random_prompts(1, [9], seed=5), GREEDY, use_tqdm=False)
    body = generate_latest(REGISTRY).decode()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f'vllm:spec_decode_{name}_total{{model_name="{path}"}}' in body
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{path}",position="0"}}' in body
