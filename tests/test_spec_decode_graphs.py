"""Verification steps through the CUDA-graph path: a sequence's last token and its proposals run as
single-token rows (one block table row and context length per token) in the decode graphs.

On the CPU the graphs are replaced by an eager stand-in that keeps the real static buffers and
their copying (only ``torch.cuda.CUDAGraph`` itself is missing), so the row layout is checked
against HF transformers here; the CUDA test replays real graphs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import MistralConfig

from hearth_llm.engine import SamplingParams
from hearth_llm.engine.cuda_graphs import DecodeGraphs, as_single_token_rows, capture_sizes, graph_rows

from conftest import TINY_COMMON, hf_greedy, random_prompts
from model_equality import save_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PLAIN = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, speculative=False)


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose "replay" runs the captured shape eagerly: every row count is "captured"
    (the CPU cache write has no padding slot -1), and the metadata's ``max_context_len`` is exact
    (the CPU decode kernel trims keys by it; the CUDA one only sizes its partitions)."""

    def _capture_sizes(self, max_rows: int) -> list[int]:
        return list(range(1, max_rows + 1))

    def _capture_all(self) -> None:
        self.replayed_rows: list[int] = []
        self.graphs = {size: _EagerReplay(self, size) for size in self.sizes}

    def _metadata(self, size: int):
        meta = super()._metadata(size)
        meta.max_context_len = int(self.context_lens[:size].max())
        return meta


class _EagerReplay:
    def __init__(self, graphs: EagerGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.replayed_rows.append(self.size)
        self.graphs.outputs[self.size] = self.graphs._forward(self.size)


def _with_eager_graphs(engine) -> EagerGraphs:
    runner = engine.runner
    runner.decode_graphs = EagerGraphs(runner.model, runner.kv_caches, graph_rows(4, runner.num_speculative_tokens),
                                       engine.max_model_len, runner.block_size, runner.device)
    return runner.decode_graphs


def _repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random span: prompt lookup finds proposals, and some are accepted."""
    return [span * 3 for span in random_prompts(count, [7, 4, 9, 5], seed=seed)]


def _generate(engine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    tokens = {request_id: [] for request_id in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request.request_id] += delta.new_token_ids
    return [tokens[request_id] for request_id in ids]


@pytest.fixture(scope="module")
def sliding_window_model(tmp_path_factory):
    config = MistralConfig(**TINY_COMMON, sliding_window=6, architectures=["MistralForCausalLM"])
    return save_tiny_model(config, tmp_path_factory.mktemp("spec_graphs") / "mistral_sw6")


def test_single_token_rows_repeat_the_table_and_count_each_tokens_context():
    table = np.array([[3, 4], [9, 0]])
    rows, context_lens = as_single_token_rows(table, np.array([0, 0, 1]), np.array([20, 21, 5]))
    assert rows.tolist() == [[3, 4], [3, 4], [9, 0]]
    assert context_lens.tolist() == [21, 22, 6]


def test_graphs_cover_every_sequence_verifying_all_its_proposals():
    assert graph_rows(4, 0) == 4 and graph_rows(4, 4) == 20 and graph_rows(256, 4) == 512
    assert capture_sizes(5) == [1, 2, 4, 8] and capture_sizes(20)[-1] == 32 and capture_sizes(64)[-1] == 64


class CopyLastTokenProposer:
    """Proposes copies of the last token: a draft every step whatever the random model's tokens
    (n-gram lookups may find none), mostly rejected."""

    def propose(self, requests, max_num_tokens: list[int]) -> list[list[int]]:
        return [[r.token_ids[-1]] * room for r, room in zip(requests, max_num_tokens)]

    def forget_finished(self) -> None:
        pass


def _self_draft(path) -> dict:
    """The target drafting for itself: every proposal is accepted (ngram ones mostly are not)."""
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4, "kv_cache_memory": "4MiB"}


@pytest.mark.parametrize("model, method", [("llama", "copy_last"), ("llama", "self_draft"),
                                           ("sliding_window", "self_draft")])
def test_verify_steps_as_graph_rows_match_hf(model, method, tiny_model_dirs, sliding_window_model, make_engine):
    path = tiny_model_dirs["llama"] if model == "llama" else sliding_window_model
    speculative = NGRAM if method == "copy_last" else _self_draft(path)
    engine = make_engine(path, dtype="float32", device="cpu", speculative=speculative, kv_cache_memory="4MiB",
                         max_num_seqs=4)
    if method == "copy_last":
        engine.proposer = CopyLastTokenProposer()
    graphs = _with_eager_graphs(engine)
    prompts = _repetitive_prompts(3, seed=5)
    outputs = _generate(engine, prompts, [GREEDY, PLAIN, GREEDY])
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == hf_greedy(path, prompt, MAX_TOKENS)
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0
    if method == "self_draft":
        assert stats["spec_decode_acceptance_rate"] == 1.0
    # verification steps (more rows than the 3 sequences) went through the graphs, not the eager path
    assert max(graphs.replayed_rows) > 3 and graphs.num_replayed_rows == sum(graphs.replayed_rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", ["copy_last", "self_draft"])
def test_cuda_verify_steps_replay_graphs_and_match_hf(method, tiny_model_dirs, make_engine):
    path = tiny_model_dirs["llama"]
    speculative = NGRAM if method == "copy_last" else _self_draft(path)
    engine = make_engine(path, dtype="float32", device="cuda", speculative=speculative, kv_cache_memory="4MiB",
                         max_num_seqs=4)
    if method == "copy_last":
        engine.proposer = CopyLastTokenProposer()
    graphs = engine.runner.decode_graphs
    assert graphs.supports(4 * 5)
    replayed_rows = []
    run = graphs.run
    graphs.run = lambda input_ids, *rest: replayed_rows.append(input_ids.shape[0]) or run(input_ids, *rest)
    prompts = _repetitive_prompts(4, seed=6)
    outputs = _generate(engine, prompts, [GREEDY, PLAIN, GREEDY, GREEDY])
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == hf_greedy(path, prompt, MAX_TOKENS)
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0
    # every step after the prefill replayed a graph, verification steps (more rows than the 4 sequences) too
    assert len(replayed_rows) == stats["num_steps"] - 1 and max(replayed_rows) > 4
