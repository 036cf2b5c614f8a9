"""Shared fixtures: tiny random-weight models of real architectures, written to disk as HF dirs,
the reference HF transformers model for each, and a check that every engine ends with its pool whole."""
from __future__ import annotations

import os
import sys

# The repo root holds our `kernels/` (installed as hearth_llm.kernels); on sys.path (`python -m pytest` from
# the root puts it there) it shadows the Hub's `kernels` package that transformers >= 5.25 imports. Drop it,
# and keep the subprocesses tests start from adding it back (a safe path, Python 3.11+; the Makefile sets it too).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _ROOT]
os.environ.setdefault("PYTHONSAFEPATH", "1")

# Before torch loads: OpenMP threads that spin while idle starve each other when several torch
# processes (or engine threads) share two cores; a 1 ms matmul then takes 40 ms.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (imports no triton; transformers' model classes do, through dynamo)

# The Triton kernels run on CPU only in the interpreter, which must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools
import zlib
from pathlib import Path

from hypothesis import settings

# The fuzz tests draw the same examples on every run, so CI cannot fail on a case drawn for the
# first time there; `HYPOTHESIS_PROFILE=explore` draws fresh ones to hunt for new bugs.
settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3Config)

from hearth_llm.engine import LLM, EngineConfig, LLMEngine

TINY_VOCAB = 320
TINY_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY_COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
    "llama3-rope": lambda: LlamaConfig(**{**TINY_COMMON, "num_key_value_heads": 1}, rope_theta=500000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                                       tie_word_embeddings=True, architectures=["LlamaForCausalLM"]),
    "mistral": lambda: MistralConfig(**TINY_COMMON, sliding_window=4096, architectures=["MistralForCausalLM"]),
    "qwen2": lambda: Qwen2Config(**TINY_COMMON, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]),
    "qwen3": lambda: Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=True,
                                 architectures=["Qwen3ForCausalLM"]),
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary; the engine tests feed token ids anyway."""
    vocab = {f"w{i}": i for i in range(TINY_VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w1", eos_token="w2", pad_token="w0",
                                   unk_token="w3")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for name, make_config in TINY_CONFIGS.items():
        # zlib.crc32, not hash(): str hashes change per process (PYTHONHASHSEED), and so would every model
        torch.manual_seed(zlib.crc32(name.encode()) % 1000)
        model = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32)
        # Random init gives near-uniform logits; a wider spread makes greedy choices well separated.
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 0.2)
        path = root / name
        model.save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
        dirs[name] = path
    return dirs


@functools.cache
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers greedy continuation, EOS ignored: the independent reference."""
    model = hf_model(str(path))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def assert_pool_whole(stats: dict) -> None:
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats


@pytest.fixture
def make_llm():
    """Build an LLM; after the test its KV pool must be whole again, then it is closed (so the
    next test's LLM on the same model starts a fresh engine and cache)."""
    created = []

    def build(model, **kwargs) -> LLM:
        kwargs.setdefault("show_progress", False)
        llm = LLM(str(model), **kwargs)
        created.append(llm)
        return llm

    yield build
    try:
        for llm in created:
            assert_pool_whole(llm.stats())
    finally:
        for llm in created:
            llm.close()


@pytest.fixture
def make_engine():
    """Build a bare LLMEngine to drive step by step; its pool must be whole after the test."""
    created = []

    def build(model, **kwargs) -> LLMEngine:
        kwargs.setdefault("show_progress", False)
        engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        created.append(engine)
        return engine

    yield build
    for engine in created:
        assert_pool_whole(engine.stats())


def record_steps_at_abort(core, monkeypatch) -> list[int]:
    """The engine's step count at each abort ``core`` is handed (a stream left or closed), in order.
    Counted when the abort reaches the engine: when the event loop gets round to closing a left async
    generator is the OS's and asyncio's doing, not the engine's."""
    steps = []
    enqueue_abort = core._abort_stream

    def record_abort(stream):
        steps.append(core.stats()["num_steps"])
        enqueue_abort(stream)

    monkeypatch.setattr(core, "_abort_stream", record_abort)
    return steps


def random_prompts(count: int, lengths, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, TINY_VOCAB, (lengths[i % len(lengths)],), generator=generator).tolist()
            for i in range(count)]


@pytest.fixture(scope="session")
def default_llm():
    """The bundled SmolLM2-135M-Instruct in float32 (compared against float32 transformers),
    loaded once for the session."""
    return LLM("default", dtype="float32", show_progress=False)


@pytest.fixture
def smollm2(default_llm):
    yield default_llm
    assert_pool_whole(default_llm.stats())


def pytest_addoption(parser):
    parser.addoption("--stress-requests", type=int, default=300, help="requests in tests/test_stress.py")
