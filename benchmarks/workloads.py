"""The GPU benchmark's workloads as token ids: the same lists on our side and on vLLM's.

Plain Python (``random`` only): ``throughput.py`` runs them through our engine, ``vllm_side.py``
through vLLM in its own process, and both draw exactly these ids.

- :func:`workload`: nano-vllm's benchmark, ``num_seqs`` prompts with input and output lengths
  uniform in ``[low, high]`` (256, [100, 1024], seed 0), EOS ignored, greedy;
- :func:`warmup_batches`: 1, 16 and 17 other prompts of 4 tokens each before the timed run;
- :data:`BS1_PROMPT` / :data:`BS1_NEW_TOKENS`: batch-1 decode, ``(time of 1 + 256 tokens - time of
  1 token) / 256``, best of 3;
- :func:`prefix_burst`: ``num_requests`` prompts = one shared ``prefix_len``-token prefix + ``own_len``
  tokens each, ``max_tokens`` 1, all at once: once with a prefix never seen, once with a prefix one
  earlier request (the primer) has computed;
- :func:`long_context`: ``num_requests`` prompts of ``prompt_len`` tokens, ``max_tokens`` new each.

>>> burst = prefix_burst(num_requests=2, prefix_len=4, own_len=1)
>>> burst["cold"][0][:4] == burst["cold"][1][:4], burst["warm"][0][:4] == burst["primer"][:4]
(True, True)
"""
from __future__ import annotations

import random

TOKEN_ID_RANGE = (0, 10000)          # every shape's vocabulary covers these ids
BS1_PROMPT = list(range(100, 228))   # 128 tokens
BS1_NEW_TOKENS = 256
BS1_REPEATS = 3
PREFIX_BURST = (64, 2048, 64)        # requests, shared prefix tokens, own tokens
LONG_CONTEXT = (32, 8192, 512)       # requests, prompt tokens, new tokens each


def workload(num_seqs: int = 256, seed: int = 0, low: int = 100, high: int = 1024) -> list[tuple[list[int], int]]:
    """``(prompt ids, max_tokens)`` for each sequence."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_seqs):
        prompt = [rng.randint(*TOKEN_ID_RANGE) for _ in range(rng.randint(low, high))]
        requests.append((prompt, rng.randint(low, high)))
    return requests


def warmup_batches(low: int = 100, high: int = 1024) -> list[list[list[int]]]:
    """Batches of 1, 16 and 17 prompts (other ids than the workload's: no prefix hits later), each
    generated with ``max_tokens=4``: they compile every kernel specialization the workload meets."""
    return [[prompt for prompt, _ in workload(count, seed=count, low=low, high=high)] for count in (1, 16, 17)]


def prefix_burst(num_requests: int = PREFIX_BURST[0], prefix_len: int = PREFIX_BURST[1],
                 own_len: int = PREFIX_BURST[2], seed: int = 7) -> dict[str, list]:
    """``{"cold": prompts, "primer": prompt, "warm": prompts}``; cold and warm have different prefixes."""
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randint(*TOKEN_ID_RANGE) for _ in range(count)]

    cold_prefix = ids(prefix_len)
    cold = [cold_prefix + ids(own_len) for _ in range(num_requests)]
    warm_prefix = ids(prefix_len)
    primer = warm_prefix + ids(own_len)
    warm = [warm_prefix + ids(own_len) for _ in range(num_requests)]
    return {"cold": cold, "primer": primer, "warm": warm}


def long_context(num_requests: int = LONG_CONTEXT[0], prompt_len: int = LONG_CONTEXT[1],
                 max_tokens: int = LONG_CONTEXT[2], seed: int = 11) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randint(*TOKEN_ID_RANGE) for _ in range(prompt_len)], max_tokens) for _ in range(num_requests)]


def max_model_len_for(long_context_shape: tuple[int, int, int] | None, default: int = 4096) -> int:
    """One ``max_model_len`` for every workload of a run: the long-context prompts plus their new
    tokens when that workload runs (8,704 for 8,192 + 512), else ``default`` (the workload's 2,048 fit)."""
    if long_context_shape is None:
        return default
    _, prompt_len, max_tokens = long_context_shape
    return max(default, prompt_len + max_tokens)
