"""A CPU verification step's GGUF block head runs its rows two at a time and stops at the first
rejected proposal (``ModelRunner._greedy_verify_logits``): the greedy tokens stay those of the plain
run, wherever the rejection falls; requests that need every row's logits (logprobs) still get them."""
from __future__ import annotations

import pytest
import torch

from hearth_llm.engine import SamplingParams
from hearth_llm.engine.models.cpu_weights import CpuBlockLogitsHead
from hearth_llm.kernels.quant import gguf_cpu_native

from conftest import TINY_VOCAB, random_prompts
from gguf_writer import add_block_layers, add_q8_0_embedding_and_norm, tiny_llama_writer, write_and_close
from test_quant_gguf import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, _layer_blocks

pytestmark = pytest.mark.skipif(not gguf_cpu_native.available(), reason="the GGUF C kernels are not built here")
K = 4


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    """A tiny Llama of Q8_0 linears and a tied Q8_0 embedding: its head stays blocks (CpuBlockLogitsHead)."""
    path = tmp_path_factory.mktemp("spec_head") / "q8.gguf"
    writer = tiny_llama_writer(path, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS)
    add_q8_0_embedding_and_norm(writer, TINY_VOCAB, HIDDEN)
    add_block_layers(writer, [("Q8_0",) * 7] * LAYERS, HIDDEN, _layer_blocks)
    write_and_close(writer)
    return path


class WrongAt:
    """Proposes the plain run's next tokens with the one at ``wrong[step % len(wrong)]`` changed
    (None: all right), so rejections fall at every position in turn."""

    def __init__(self, prompt_len: int, reference: list[int], wrong: list[int | None]) -> None:
        self.prompt_len, self.reference, self.wrong, self.step = prompt_len, reference, wrong, 0
        self.sent: list[tuple[list[int], int | None]] = []

    def propose(self, requests, max_num_tokens):
        done = len(requests[0].token_ids) - self.prompt_len
        proposal = list(self.reference[done:done + max_num_tokens[0]])
        wrong = self.wrong[self.step % len(self.wrong)]
        self.step += 1
        if wrong is not None and wrong < len(proposal):
            proposal[wrong] = (proposal[wrong] + 1) % TINY_VOCAB
        else:
            wrong = None
        self.sent.append((proposal, wrong))
        return [proposal]

    def forget_finished(self) -> None:
        pass


def run(engine, prompt, params) -> list[int]:
    engine.add_request(prompt, params)
    tokens = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
    return tokens


def head_calls_per_step(engine) -> list[tuple[list[int], list[int]]]:
    """Wraps the runner: per step, (the proposals verified, the row count of each logits-head call)."""
    model, runner = engine.runner.model, engine.runner
    assert isinstance(model.lm_head, CpuBlockLogitsHead)
    steps, compute_logits, forward = [], model.compute_logits, runner.run

    def counted(hidden):
        steps[-1][1].append(hidden.shape[0])
        return compute_logits(hidden)

    def run_step(batch, *args):
        steps.append((batch.proposals_of(0), []))
        return forward(batch, *args)

    model.compute_logits, runner.run = counted, run_step
    return steps


def expected_calls(proposal: list[int], wrong: int | None, in_pairs: bool) -> list[int]:
    """``in_pairs`` (a head that runs a step's rows two at a time): pairs of rows up to the one whose
    draw rejects its proposal (``wrong``), all if none does; a step of at most 2 rows in one call.
    Else (a head that runs all rows in one pass) one call."""
    num_rows = 1 + len(proposal)
    if num_rows <= 2 or not in_pairs:
        return [num_rows]
    needed = num_rows if wrong is None else min(num_rows, 2 * (wrong // 2 + 1))
    return [min(2, needed - start) for start in range(0, needed, 2)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_stops_at_the_first_rejected_proposal_and_the_tokens_stay_the_plain_runs(q8_file, dtype,
                                                                                          make_engine):
    if dtype == "float32" and not gguf_cpu_native.has_panels("Q8_0"):
        pytest.skip("a float32 Q8_0 head stays blocks only with the AVX2 kernels")
    engine = make_engine(q8_file, dtype=dtype, device="cpu", kv_cache_memory="4MiB", num_threads=1,
                         enable_prefix_caching=False,
                         speculative={"method": "ngram", "num_speculative_tokens": K, "adaptive_proposal_length": False})
    prompt = random_prompts(1, [11], seed=5)[0]
    greedy = dict(temperature=0, max_tokens=30, ignore_eos=True)
    plain = run(engine, prompt, SamplingParams(**greedy, speculative=False))
    proposer = WrongAt(len(prompt), plain, wrong=[0, None, 1, 2, 3, None])
    engine.proposer = proposer
    steps = head_calls_per_step(engine)
    assert run(engine, prompt, SamplingParams(**greedy)) == plain
    verifies = [(proposal, calls) for proposal, calls in steps if proposal]
    sent = [(proposal, wrong) for proposal, wrong in proposer.sent if proposal]
    assert [proposal for proposal, _ in verifies] == [proposal for proposal, _ in sent]
    assert {wrong for _, wrong in sent} == {0, 1, 2, 3, None}
    # the float32 GEMV's head runs rows in pairs; in bf16 the bf16 kernel, where built for the head's
    # type, runs them all in one pass (each row's bits as alone)
    head = engine.runner.model.lm_head
    in_pairs = dtype == "float32" or head.bf16_gemv is None
    for (proposal, calls), (_, wrong) in zip(verifies, sent):
        assert calls == expected_calls(proposal, wrong, in_pairs), (proposal, wrong)
    assert all(calls == [1] for proposal, calls in steps if not proposal)
    if in_pairs:   # rows were saved
        assert sum(sum(calls) for _, calls in verifies) < sum(1 + len(proposal) for proposal, _ in verifies)


def test_requests_that_want_logprobs_get_every_verified_rows_logits(q8_file, make_engine):
    engine = make_engine(q8_file, dtype="bfloat16", device="cpu", kv_cache_memory="4MiB", num_threads=1,
                         enable_prefix_caching=False,
                         speculative={"method": "ngram", "num_speculative_tokens": K, "adaptive_proposal_length": False})
    prompt = random_prompts(1, [9], seed=8)[0]
    params = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    plain = run(engine, prompt, SamplingParams(**params, speculative=False))
    proposer = WrongAt(len(prompt), plain, wrong=[0])
    engine.proposer = proposer
    steps = head_calls_per_step(engine)
    assert run(engine, prompt, SamplingParams(**params)) == plain
    # every row of each verify step through the head in one call (the head pairs them itself)
    assert any(proposal for proposal, _ in steps)
    assert all(calls == [1 + len(proposal)] for proposal, calls in steps)
