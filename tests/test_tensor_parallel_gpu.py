"""Tensor parallelism over NCCL: needs two CUDA devices (skipped otherwise; not run yet: the lent
GPU machine has one). Greedy tokens of TP=2 equal TP=1 on a tiny fp32 Llama and Qwen3, with and
without CUDA graphs (each rank captures its own, all-reduces included), and a killed worker
stops the engine with EngineDeadError.

    python -m pytest -q tests/test_tensor_parallel_gpu.py      # on a machine with >= 2 GPUs
"""
from __future__ import annotations

import os
import signal

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from hearth_llm.engine import LLM, EngineDeadError, SamplingParams

from conftest import TINY_COMMON, random_prompts
from model_equality import save_tiny_model

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY_COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
    "qwen3": lambda: Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=True,
                                 architectures=["Qwen3ForCausalLM"]),
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
GPU = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB", show_progress=False)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_over_nccl_equals_tp1(name, cuda_graphs, tmp_path):
    path = save_tiny_model(CONFIGS[name](), tmp_path / name, seed=len(name))
    prompts = random_prompts(6, [3, 40, 17, 1], seed=5)
    with LLM(str(path), cuda_graphs=cuda_graphs, **GPU) as single:
        expected = _tokens(single, prompts)
    with LLM(str(path), tensor_parallel_size=2, cuda_graphs=cuda_graphs, **GPU) as llm:
        assert _tokens(llm, prompts) == expected
        assert _tokens(llm, prompts[:1]) == expected[:1]


def test_killed_gpu_worker_stops_the_engine(tmp_path):
    path = save_tiny_model(CONFIGS["llama"](), tmp_path / "llama")
    llm = LLM(str(path), tensor_parallel_size=2, cuda_graphs=False, **GPU)
    try:
        os.kill(llm.engine.runner.pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    finally:
        llm.close()
