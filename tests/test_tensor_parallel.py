"""Tensor parallelism on the CPU: two gloo worker processes split a tiny fp32 model, and greedy
tokens equal HF transformers and the single-process engine; a killed or hung worker stops the
engine with EngineDeadError and leaves no process behind.

Each TP engine costs two worker processes (the first ones most of this file's time: the
forkserver imports torch and transformers once), so each model's engine is built once per
module; the failure tests stop those engines and therefore run last.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config, Starcoder2Config

from hearth_llm.engine import LLM, EngineDeadError, SamplingParams
from hearth_llm.engine.memory.weights import weights_bytes
from hearth_llm.engine.models.linear import LinearBase, TensorParallel
from hearth_llm.engine.models.vocab_parallel import VocabParallelEmbedding, VocabParallelLMHead

from conftest import TINY_COMMON, assert_pool_whole, random_prompts
from model_equality import (GREEDY, assert_matches_hf, check_alone_and_batched, check_chunked_prefill,
                            check_prefix_hits, save_tiny_model)

CONFIGS = {
    # one KV head for two ranks: each rank keeps a copy of it
    "llama": lambda: LlamaConfig(**{**TINY_COMMON, "num_key_value_heads": 1}, tie_word_embeddings=False,
                                 architectures=["LlamaForCausalLM"]),
    # two KV heads: one per rank; q/k norm; tied embeddings
    "qwen3": lambda: Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=True,
                                 architectures=["Qwen3ForCausalLM"]),
}
# The CPU even where CUDA is visible: gloo processes on any machine (tests/test_tensor_parallel_gpu.py: NCCL).
CPU = dict(device="cpu", dtype="float32", show_progress=False)
TP_KWARGS = dict(tensor_parallel_size=2, block_size=8, **CPU)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    return {name: save_tiny_model(make(), root / name, seed=len(name)) for name, make in CONFIGS.items()}


@pytest.fixture(scope="module")
def tp_llms(model_dirs):
    """One TP=2 engine per model, built on first use and closed at the end of the module."""
    built = {}

    def get(name: str) -> LLM:
        if name not in built:
            built[name] = LLM(str(model_dirs[name]), **TP_KWARGS)
        return built[name]

    yield get
    for llm in built.values():
        llm.close()


def _shared(llm: LLM):
    """A ``make_llm`` for the harness that hands out the module's engine (built with block_size=8)."""
    def make(path, **kwargs):
        assert kwargs.get("block_size", 8) == 8, kwargs
        return llm
    return make


def test_tp2_llama_with_replicated_kv_head_matches_hf_alone_batched_and_with_prefix_hits(model_dirs, tp_llms):
    llm = tp_llms("llama")
    assert llm.engine.runner.size == 2 and len(set(llm.engine.runner.pids)) == 2
    check_alone_and_batched(model_dirs["llama"], _shared(llm))
    check_prefix_hits(model_dirs["llama"], _shared(llm))
    assert_pool_whole(llm.stats())


def test_tp2_qwen3_matches_hf_and_single_process(model_dirs, tp_llms):
    path, llm = model_dirs["qwen3"], tp_llms("qwen3")
    check_alone_and_batched(path, _shared(llm))
    prompts = random_prompts(5, [9, 40, 2], seed=21)
    with LLM(str(path), block_size=8, **CPU) as single:
        expected = [out.outputs[0].token_ids for out in single.generate(prompts, GREEDY, use_tqdm=False)]
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert_pool_whole(llm.stats())


def test_tp2_row_parallel_biases_and_plain_mlp_match_hf(tmp_path):
    # StarCoder2: biases on every projection (o_proj's and c_proj's added once, after their all-reduce, on
    # every rank: a bias kept on rank 0 only made the ranks' hidden states drift apart), LayerNorm, up/down MLP.
    config = Starcoder2Config(**TINY_COMMON, sliding_window=12, norm_epsilon=1e-5,
                              architectures=["Starcoder2ForCausalLM"])
    path = save_tiny_model(config, tmp_path / "starcoder2", seed=10)
    prompts = random_prompts(4, [3, 30, 11, 1], seed=41)
    with LLM(str(path), **TP_KWARGS) as llm:
        assert_matches_hf(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_each_rank_holds_only_its_slice_of_the_weights(model_dirs, tp_llms):
    llm = tp_llms("qwen3")
    with LLM(str(model_dirs["qwen3"]), block_size=8, **CPU) as single:
        model = single.engine.runner.model
        split = _split_bytes(model)
        expected = weights_bytes(model) - split + split // 2  # norms and rotary tables stay whole
    assert split > weights_bytes(model) // 2
    assert llm.engine.runner.rank_weights_bytes == [expected, expected]


def _split_bytes(model) -> int:
    """Bytes of the tensors ranks split (linear layers, embedding, head; a tied one counted once)."""
    split_modules = [m for m in model.modules() if isinstance(m, LinearBase)] + [model.embed_tokens, model.lm_head]
    tensors = {id(t): t for m in split_modules for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_tp2_matches_hf_under_forced_preemption_and_chunked_prefill(model_dirs, tp_llms):
    path = model_dirs["llama"]
    bytes_per_block = tp_llms("llama").engine.runner.bytes_per_block // 2  # blocks of 4 tokens, not 8
    # Room for 96 tokens per rank; 16 tokens per step: prompts of up to 70 tokens prefill in chunks.
    with LLM(str(path), **{**TP_KWARGS, "block_size": 4}, kv_cache_memory=24 * bytes_per_block,
             max_model_len=96, max_num_batched_tokens=16) as llm:
        prompts = random_prompts(8, [30, 12, 25, 40], seed=15)
        assert_matches_hf(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
        assert llm.stats()["num_preemptions"] > 0
        check_chunked_prefill(path, lambda path, **kwargs: llm)
        assert_pool_whole(llm.stats())


def test_sleep_is_refused_by_name(tp_llms):
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        tp_llms("qwen3").sleep(level=1)

@pytest.mark.parametrize("kwargs, field", [
    (dict(tensor_parallel_size=3), "num_attention_heads=4"),          # 4 heads over 3 ranks
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive int"),
    (dict(tensor_parallel_size=2, keep_alive=5), "keep_alive"),
])
def test_unsplittable_settings_are_refused_by_name_before_workers_start(model_dirs, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(model_dirs["qwen3"]), **CPU, **kwargs)


def test_a_worker_refusing_its_checkpoint_raises_value_error_in_the_driver(model_dirs, tmp_path):
    # The workers check the checkpoint against the config while loading (the driver reads no header):
    # their ValueError reaches the caller as one, as it does with one process, not as EngineDeadError.
    path = tmp_path / "bad"
    path.mkdir()
    for file in model_dirs["qwen3"].iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96  # the file's MLP weights have 128 rows
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tensor-parallel rank [01]: .*shape"):
        LLM(str(path), **TP_KWARGS)


def test_killed_worker_fails_pending_requests_with_engine_dead_and_reaps_workers(model_dirs, tp_llms):
    llm = tp_llms("llama")  # runs last in this module: it kills this engine
    executor = llm.engine.runner
    long_run = SamplingParams(temperature=0, max_tokens=800, ignore_eos=True)
    outcome = {}

    def generate():
        try:
            outcome["outputs"] = llm.generate(random_prompts(3, [5], seed=31), long_run, use_tqdm=False)
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            outcome["error"] = error

    num_tokens_before = llm.stats()["num_generation_tokens"]
    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 20
    while llm.stats()["num_generation_tokens"] < num_tokens_before + 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.stats()["num_running"] > 0, "the requests should be mid-generation when the worker dies"
    killed_at = time.monotonic()
    os.kill(executor.pids[1], signal.SIGKILL)
    thread.join(15)
    assert not thread.is_alive(), "generate() hung after a worker died"
    assert isinstance(outcome.get("error"), EngineDeadError), outcome
    assert time.monotonic() - killed_at < 10
    for pid in executor.pids:  # reaped: not even a zombie answers signal 0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(EngineDeadError):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


def test_hung_worker_fails_the_step_after_the_timeout_and_is_killed(tp_llms):
    llm = tp_llms("qwen3")  # runs after the Qwen3 equality test: it stops this engine
    executor = llm.engine.runner
    executor.step_timeout_s = 1.0
    os.kill(executor.pids[1], signal.SIGSTOP)  # alive but silent: only the timeout can tell
    started = time.monotonic()
    with pytest.raises(EngineDeadError):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 6
    for pid in executor.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("vocab, size", [(10, 2), (7, 2), (5, 3)])
def test_vocab_parallel_embedding_and_head_sum_to_the_whole(vocab, size):
    weight = torch.randn(vocab, 4)
    ids, hidden = torch.tensor([0, vocab - 1, 3 % vocab, 1]), torch.randn(3, 4)
    embeddings, logits = 0, 0
    for rank in range(size):  # each rank's part before the all-reduce; the all-reduce is their sum
        parallel = TensorParallel(rank=rank, size=size, all_reduce=lambda tensor: None)
        embed, head = VocabParallelEmbedding(vocab, 4, parallel), VocabParallelLMHead(vocab, 4, parallel)
        embed.weight.weight_loader(embed.weight, weight)
        head.weight.weight_loader(head.weight, weight)
        assert embed.weight.shape == (-(-vocab // size), 4)
        embeddings, logits = embeddings + embed(ids), logits + head(hidden)
    torch.testing.assert_close(embeddings, torch.nn.functional.embedding(ids, weight), rtol=0, atol=0)
    torch.testing.assert_close(logits, hidden @ weight.T)
