"""The HF-equality contract every architecture meets, written once: greedy tokens equal to HF
transformers (fp32, CPU) alone, batched, with prefix-cache hits, under forced preemption and with
chunked prefill. A model test file builds tiny random configs and calls :func:`check_matches_hf`.

>>> CONFIGS = {"gemma2": lambda: Gemma2Config(**TINY_COMMON, ...)}
>>> @pytest.mark.parametrize("name", sorted(CONFIGS))
... def test_gemma_matches_hf(name, tmp_path, make_llm):
...     check_matches_hf(save_tiny_model(CONFIGS[name](), tmp_path / name), make_llm)
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hearth_llm.engine import LLM, SamplingParams

from conftest import hf_greedy, random_prompts, tiny_tokenizer

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def save_tiny_model(config, path: Path, seed: int = 0, std: float = 0.2) -> Path:
    """A random-weight HF model of ``config`` saved with the tiny tokenizer; weights of rank ≥ 2
    drawn with a wide spread so greedy choices are well separated; 1-D ones (norms, biases) drawn
    near their init so a wrong ``1 + w`` or a missing bias shows."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, std)
            else:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


class TinyModelDirs:
    """Saved tiny models of named configs, each built on first use (seed: the name's length).

    >>> model_dir = TinyModelDirs(CONFIGS, tmp_path_factory.mktemp)
    >>> check_matches_hf(model_dir("olmo2"), make_llm)
    """

    def __init__(self, configs: dict, make_dir) -> None:
        self._configs, self._make_dir, self._built = configs, make_dir, {}

    def __call__(self, name: str) -> Path:
        if name not in self._built:
            self._built[name] = save_tiny_model(self._configs[name](), self._make_dir(name), seed=len(name))
        return self._built[name]


def assert_matches_hf(path, prompts, outputs, max_tokens: int = MAX_TOKENS) -> None:
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(path, prompt, max_tokens)
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"


def check_alone_and_batched(path, make_llm, **engine_kwargs) -> None:
    llm = make_llm(path, **engine_kwargs)
    alone = random_prompts(2, [1, 29], seed=11)
    for prompt in alone:
        assert_matches_hf(path, [prompt], llm.generate([prompt], GREEDY, use_tqdm=False))
    batch = random_prompts(8, [3, 50, 17, 1, 33, 9], seed=12)
    assert_matches_hf(path, batch, llm.generate(batch, GREEDY, use_tqdm=False))


def check_prefix_hits(path, make_llm, **engine_kwargs) -> None:
    llm = make_llm(path, block_size=8, **engine_kwargs)
    prefix = random_prompts(1, [40], seed=13)[0]
    prompts = [prefix + suffix for suffix in random_prompts(3, [3, 11, 1], seed=14)]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(out.num_cached_tokens == 40 for out in rest), [out.num_cached_tokens for out in rest]
    assert_matches_hf(path, prompts, first + rest)


def check_forced_preemption(path, make_llm, **engine_kwargs) -> None:
    # Room for 96 tokens in all: 8 prompts of up to 40 + 16 tokens cannot all stay resident.
    with LLM(str(path), block_size=4, show_progress=False, **engine_kwargs) as probe:
        bytes_per_block = probe.engine.runner.bytes_per_block
    llm = make_llm(path, block_size=4, kv_cache_memory=24 * bytes_per_block, max_model_len=96, **engine_kwargs)
    prompts = random_prompts(8, [30, 12, 25, 40], seed=15)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert_matches_hf(path, prompts, outputs)


def check_chunked_prefill(path, make_llm, **engine_kwargs) -> None:
    llm = make_llm(path, max_num_batched_tokens=16, **engine_kwargs)
    prompts = random_prompts(4, [70, 5, 33], seed=16)
    assert_matches_hf(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


CHECKS = {
    "alone_and_batched": check_alone_and_batched,
    "prefix_hits": check_prefix_hits,
    "forced_preemption": check_forced_preemption,
    "chunked_prefill": check_chunked_prefill,
}


def check_matches_hf(path, make_llm, **engine_kwargs) -> None:
    """Every check above on one model directory."""
    for check in CHECKS.values():
        check(path, make_llm, **engine_kwargs)
