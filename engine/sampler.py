"""Turns logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeded draws, logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth_llm import kernels

from .request import Request


@dataclass(slots=True)
class SampledTokens:
    token_ids: list[int]
    # Per row: {token_id: (logprob, rank)} for the top-N plus the sampled token, or None.
    logprobs: list[dict[int, tuple[float, int]] | None]


class Sampler:
    """Samples one token per row; each row's randomness comes from its own generator when the
    request has a seed, so a seeded request draws the same tokens alone or in any batch."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._cuda_generator: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor, requests: list[Request], apply_grammar_masks=None) -> SampledTokens:
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if apply_grammar_masks is not None and any(r.matcher is not None for r in requests):
            apply_grammar_masks(logits, [r.matcher for r in requests])
        logits = self._apply_penalties(logits, requests)
        logits = _block_early_stop(logits, requests)
        token_ids = self._choose(logits, requests)
        logprobs = [
            _top_logprobs(raw_logprobs[row], token_ids[row], r.sampling_params.logprobs)
            if r.sampling_params.logprobs is not None else None
            for row, r in enumerate(requests)
        ]
        return SampledTokens(token_ids=token_ids, logprobs=logprobs)

    def _exponential_noise(self, probs: torch.Tensor, generators: list) -> torch.Tensor:
        """One Exp(1) draw per token; seeded rows draw on the CPU from their own generator so the
        numbers don't depend on the device or the batch."""
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            if len(unseeded) == len(generators):
                noise.exponential_(generator=self._device_generator(probs.device))
            else:
                rows = torch.tensor(unseeded, device=probs.device)
                noise[rows] = torch.empty(len(unseeded), probs.shape[1], device=probs.device, dtype=probs.dtype
                                          ).exponential_(generator=self._device_generator(probs.device))
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row] = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=generator).to(probs.device)
        return noise

    def _device_generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        if self._cuda_generator is None:
            self._cuda_generator = torch.Generator(device=device).manual_seed(self.generator.initial_seed())
        return self._cuda_generator

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for row in rows:
            params = requests[row].sampling_params
            request = requests[row]
            output_ids = torch.tensor(request.output_token_ids, dtype=torch.long, device=logits.device)
            output_ids = output_ids[output_ids < vocab]
            counts = torch.bincount(output_ids, minlength=vocab).to(logits.dtype)
            if params.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                seen[torch.tensor([t for t in request.token_ids if t < vocab], dtype=torch.long,
                                  device=logits.device)] = True
                row_logits = logits[row]
                penalized = torch.where(row_logits > 0, row_logits / params.repetition_penalty,
                                        row_logits * params.repetition_penalty)
                logits[row] = torch.where(seen, penalized, row_logits)
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _choose(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        chosen = kernels.argmax(logits)
        sampled_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
            probs = _filtered_probs(logits.index_select(0, rows), [requests[i] for i in sampled_rows])
            noise = self._exponential_noise(probs, [requests[i].generator for i in sampled_rows])
            # Exponential race: argmax(p / E) draws from p with one random number per token, no cumsum.
            chosen[rows] = kernels.argmax(probs / noise)
        return chosen.tolist()


def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    params = [r.sampling_params for r in requests]
    temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temperatures[:, None]
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    min_ps = [p.min_p for p in params]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = _top_k_top_p(logits, top_ks, top_ps)
    probs = torch.softmax(logits, dim=-1)
    if any(m > 0 for m in min_ps):
        min_p = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= ks[:, None]
    sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
    remove |= mass_before >= torch.tensor(top_ps, dtype=logits.dtype, device=logits.device)[:, None]
    remove[:, 0] = False
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, filtered)


def _block_early_stop(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Until min_tokens are out, EOS and stop tokens can't be chosen."""
    rows = [i for i, r in enumerate(requests) if r.num_output_tokens < r.sampling_params.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        request = requests[row]
        banned = set(request.sampling_params.stop_token_ids)
        if not request.sampling_params.ignore_eos:
            banned |= request.eos_token_ids
        banned_ids = [t for t in banned if t < logits.shape[-1]]
        if banned_ids:
            logits[row, banned_ids] = float("-inf")
    return logits


def _top_logprobs(logprobs: torch.Tensor, token_id: int, num: int) -> dict[int, tuple[float, int]]:
    result: dict[int, tuple[float, int]] = {}
    if num > 0:
        values, indices = logprobs.topk(num)
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist()), start=1):
            result[index] = (value, rank)
    if token_id not in result:
        chosen = logprobs[token_id]
        rank = int((logprobs > chosen).sum().item()) + 1
        result[token_id] = (float(chosen), rank)
    return result
