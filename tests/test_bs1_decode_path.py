"""The batch-size-1 decode path: the one-row graph that ends in the LM head and its greedy argmax
(``cuda_graphs.HEAD_SIZES``), and the sampler taking that argmax for plain greedy rows only.

On the CPU the graphs are an eager stand-in that keeps the real static buffers, copies and the
head's outputs (only ``torch.cuda.CUDAGraph`` is missing); the CUDA test replays real graphs.
"""
from __future__ import annotations

import pytest
import torch

from hearth_llm.engine import SamplingParams
from hearth_llm.engine.cuda_graphs import HEAD_SIZES, DecodeGraphs
from hearth_llm.engine.request import Request
from hearth_llm.engine.sampler import Sampler

from conftest import hf_greedy

PROMPT = [5, 17, 33, 2, 41, 9, 12]
MAX_TOKENS = 12


class EagerHeadGraphs(DecodeGraphs):
    """DecodeGraphs whose "replay" runs the forward (and the head, for a head size) eagerly."""

    def _capture_sizes(self, max_rows: int) -> list[int]:
        return list(range(1, max_rows + 1))

    def _capture_all(self) -> None:
        self.graphs = {size: _EagerReplay(self, size) for size in self.sizes}

    def _metadata(self, size: int):
        meta = super()._metadata(size)
        meta.max_context_len = int(self.context_lens[:size].max())  # the CPU kernel trims keys by it
        return meta


class _EagerReplay:
    def __init__(self, graphs: EagerHeadGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.outputs[self.size] = self.graphs._forward_and_head(self.size)


def _with_head_graphs(engine, with_head: bool = True) -> EagerHeadGraphs:
    runner = engine.runner
    runner.decode_graphs = EagerHeadGraphs(runner.model, runner.kv_caches, 4, engine.max_model_len,
                                           runner.block_size, runner.device, with_head=with_head)
    return runner.decode_graphs


def _tokens(engine, params: SamplingParams) -> list[int]:
    request_id = engine.add_request(PROMPT, params)
    tokens = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
    engine.release(request_id)
    return tokens


def _count_choose(monkeypatch, engine) -> list[int]:
    calls = []
    original = engine.sampler._choose
    monkeypatch.setattr(engine.sampler, "_choose", lambda *args: calls.append(1) or original(*args))
    return calls


@pytest.mark.parametrize("model", ["llama", "qwen3"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_row_graph_with_the_head_gives_hf_greedy_tokens(model, async_scheduling, tiny_model_dirs, make_engine,
                                                            monkeypatch):
    path = tiny_model_dirs[model]
    engine = make_engine(path, dtype="float32", device="cpu", kv_cache_memory="4MiB", max_num_seqs=4,
                         async_scheduling=async_scheduling)
    _with_head_graphs(engine)
    choose_calls = _count_choose(monkeypatch, engine)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert _tokens(engine, params) == hf_greedy(path, PROMPT, MAX_TOKENS)
    # only the prefill step drew from the logits itself; every decode step took the graph's argmax
    assert len(choose_calls) == 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=MAX_TOKENS),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
], ids=["logprobs", "min_tokens", "penalty"])
def test_rows_that_are_not_plain_greedy_draw_from_the_graphs_logits_as_without_graphs(
        params, tiny_model_dirs, make_engine, monkeypatch):
    path = tiny_model_dirs["llama"]
    eager = make_engine(path, dtype="float32", device="cpu", kv_cache_memory="4MiB", max_num_seqs=4)
    expected = _tokens(eager, params)
    engine = make_engine(path, dtype="float32", device="cpu", kv_cache_memory="4MiB", max_num_seqs=4)
    _with_head_graphs(engine)
    choose_calls = _count_choose(monkeypatch, engine)
    assert _tokens(engine, params) == expected
    assert len(choose_calls) == MAX_TOKENS  # every step drew from the logits itself


def test_head_outputs_only_for_head_sizes_of_graphs_built_with_the_head(tiny_model_dirs, make_engine):
    engine = make_engine(tiny_model_dirs["llama"], dtype="float32", device="cpu", kv_cache_memory="4MiB",
                         max_num_seqs=4)
    graphs = _with_head_graphs(engine)
    plain = _with_head_graphs(engine, with_head=False)
    engine.runner.decode_graphs = None
    assert HEAD_SIZES == {1}
    for g in (graphs, plain):
        g.slot_mapping[:2] = torch.tensor([0, 1])  # the CPU cache write has no padding slot -1
        with torch.inference_mode():
            g.graphs[1].replay()
            g.graphs[2].replay()
    logits, token_ids = graphs.head_outputs(1)
    assert logits.shape == (1, 320) and torch.equal(token_ids, logits.argmax(dim=-1))
    assert graphs.head_outputs(2) is None and plain.head_outputs(1) is None


def _request(params: SamplingParams) -> Request:
    return Request("r", [1, 2, 3], params, frozenset())


def test_sampler_takes_the_given_argmax_for_plain_greedy_rows_only():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    given = torch.tensor([2])  # not the argmax: shows which one was taken
    sampler = Sampler(seed=0)
    greedy = _request(SamplingParams(temperature=0))
    assert sampler(logits, [greedy], greedy_token_ids=given).token_ids.tolist() == [2]
    assert sampler(logits, [greedy]).token_ids.tolist() == [1]
    for params in (SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0, min_tokens=4),
                   SamplingParams(temperature=0, presence_penalty=0.5)):
        assert sampler(logits, [_request(params)], greedy_token_ids=given).token_ids.tolist() == [1], params


def _same_inputs(fast, general) -> bool:
    """Field by field; staged inputs (views of the graphs' buffers) hold each block table row at the
    graphs' width (beyond the general builder's: whatever an earlier step left, as the graphs' own
    copies leave it), and no seq_lens (the graphs read none)."""
    def same(a, b):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                return False
            if fast.is_staged and a.dim() == 2:
                width = b.shape[1]
                return torch.equal(a[:, :width], b)
            return torch.equal(a, b)
        return a == b
    fields = ("input_ids", "positions", "logits_indices", "sampling_rows", "num_pending", "pending_positions",
              "pending_rows", "prompt_logprob_rows", "query_bounds", "row_tables", "row_context_lens")
    meta_fields = ("slot_mapping", "block_tables", "context_lens", "query_start_loc", "max_query_len",
                   "max_context_len", "flash_prefill") + (() if fast.is_staged else ("seq_lens",))
    return (all(same(getattr(fast, f), getattr(general, f)) for f in fields)
            and all(same(getattr(fast.meta, f), getattr(general.meta, f)) for f in meta_fields))


@pytest.mark.parametrize("with_graphs", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_few_decodes_build_the_general_builders_inputs(with_graphs, async_scheduling, tiny_model_dirs, make_engine,
                                                       monkeypatch):
    from hearth_llm.engine import model_runner

    path = tiny_model_dirs["qwen3"]
    engine = make_engine(path, dtype="float32", device="cpu", kv_cache_memory="4MiB", max_num_seqs=4, block_size=4,
                         async_scheduling=async_scheduling)
    if with_graphs:
        _with_head_graphs(engine)
    runner = engine.runner
    original = runner._prepare_few_decodes
    num_fast, num_staged = [], []

    def checked(batch):
        fast = original(batch)
        if fast is not None:
            monkeypatch.setattr(model_runner, "MAX_FEW_DECODE_SEQS", 0)
            general = runner._prepare_inputs(batch)
            monkeypatch.setattr(model_runner, "MAX_FEW_DECODE_SEQS", 8)
            assert _same_inputs(fast, general)
            num_fast.append(len(batch.requests))
            num_staged.append(fast.is_staged)
        return fast

    monkeypatch.setattr(runner, "_prepare_few_decodes", checked)
    # three sequences of different lengths (block boundaries at 4), finishing at different steps
    prompts = [PROMPT, PROMPT[:3], PROMPT + [7] * 6]
    ids = [engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
           for prompt, n in zip(prompts, (9, 4, 6))]
    tokens = {request_id: [] for request_id in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request.request_id] += delta.new_token_ids
    for request_id in ids:
        engine.release(request_id)
    for request_id, prompt in zip(ids, prompts):
        assert tokens[request_id] == hf_greedy(path, prompt, len(tokens[request_id]))
    assert 3 in num_fast and 1 in num_fast  # steps of three sequences and of one took the fast builder
    assert any(num_staged) == with_graphs  # and with graphs, their inputs went straight into the graphs' buffers
