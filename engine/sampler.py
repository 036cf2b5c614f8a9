"""Turns logits into next tokens: penalties, grammar masks, seeded draws, logprobs.

The per-request bookkeeping lives here; the sampling math (temperature, top-k/top-p/min-p, the
exponential race) is the kernels' ``sample_rows``, which never reads the device, so the engine can
schedule the next step while this one runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth_llm import kernels

from .request import Request


@dataclass(slots=True)
class SampledTokens:
    """One step's draws, still on the model's device until :meth:`to_host` is called.

    :meth:`start_copy` queues the copies to the host without waiting, so the next step can be
    launched before this one's tokens are read.
    """

    token_ids: torch.Tensor                        # [rows] int64
    num_logprobs: list[int | None]                 # per row: requested top-N, or None
    top_values: torch.Tensor | None = None         # [rows wanting logprobs, N max] float32
    top_indices: torch.Tensor | None = None
    chosen_values: torch.Tensor | None = None      # [rows wanting logprobs] the drawn token's logprob
    chosen_ranks: torch.Tensor | None = None
    host: dict[str, torch.Tensor] | None = None     # pinned copies, once :meth:`start_copy` has run
    ready: object | None = None                    # a CUDA event recorded after the copies

    _FIELDS = ("token_ids", "top_values", "top_indices", "chosen_values", "chosen_ranks")

    def start_copy(self) -> None:
        """Queue the copies to pinned host memory; nothing waits."""
        if self.token_ids.device.type != "cuda":
            return
        self.host = {}
        for name in self._FIELDS:
            tensor = getattr(self, name)
            if tensor is not None:
                pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self.host[name] = pinned.copy_(tensor, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def to_host(self) -> tuple[list[int], list[dict[int, tuple[float, int]] | None]]:
        """The token ids and, per row, ``{token_id: (logprob, rank)}`` (top-N plus the drawn one) or None."""
        if self.ready is not None:
            self.ready.synchronize()
        host = self.host if self.host is not None else {name: getattr(self, name) for name in self._FIELDS}
        token_ids = host["token_ids"].tolist()
        logprobs: list[dict[int, tuple[float, int]] | None] = [None] * len(token_ids)
        if host.get("chosen_values") is not None:
            top_values, top_indices = host["top_values"].tolist(), host["top_indices"].tolist()
            chosen_values, chosen_ranks = host["chosen_values"].tolist(), host["chosen_ranks"].tolist()
            rows = [row for row, num in enumerate(self.num_logprobs) if num is not None]
            for index, row in enumerate(rows):
                num = self.num_logprobs[row]
                entries = {token: (value, rank) for rank, (value, token)
                           in enumerate(zip(top_values[index][:num], top_indices[index][:num]), start=1)}
                if token_ids[row] not in entries:
                    entries[token_ids[row]] = (chosen_values[index], chosen_ranks[index])
                logprobs[row] = entries
        return token_ids, logprobs


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the device (pinned, non-blocking copy)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class Sampler:
    """Samples one token per row; each row's randomness comes from its own generator when the
    request has a seed, so a seeded request draws the same tokens alone or in any batch.

    Nothing here waits for the device (except penalties, which the engine never runs ahead of).
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._cuda_generator: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor, requests: list[Request], apply_grammar_masks=None,
                 greedy_token_ids: torch.Tensor | None = None) -> SampledTokens:
        """``greedy_token_ids``: the argmax of ``logits``' rows, computed already (a CUDA graph's
        static output, which the next replay overwrites: :meth:`SampledTokens.start_copy` copies it
        out first, in stream order); taken as the draws when every row is plain greedy with nothing
        to mask."""
        if greedy_token_ids is not None and all(_is_plain_greedy(r) and not _blocks_early_stop(r) for r in requests):
            return SampledTokens(token_ids=greedy_token_ids, num_logprobs=[None] * len(requests))
        if not all(_is_plain_greedy(r) for r in requests):
            logits = logits.float()  # a greedy argmax is the same in bf16; everything else wants float32
        num_logprobs = [r.sampling_params.logprobs for r in requests]
        logprob_rows = [row for row, num in enumerate(num_logprobs) if num is not None]
        raw_logprobs = None
        if logprob_rows:
            rows = to_device(logprob_rows, torch.long, logits.device)
            raw_logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
        if apply_grammar_masks is not None and any(r.matcher is not None for r in requests):
            apply_grammar_masks(logits, [r.matcher for r in requests])
        logits = self._apply_penalties(logits, requests)
        logits = _block_early_stop(logits, requests)
        token_ids = self._choose(logits, requests)
        sampled = SampledTokens(token_ids=token_ids, num_logprobs=num_logprobs)
        if raw_logprobs is not None:
            num_top = max(num_logprobs[row] for row in logprob_rows)
            if num_top > 0:
                sampled.top_values, sampled.top_indices = raw_logprobs.topk(num_top, dim=-1)
            else:
                sampled.top_values = raw_logprobs.new_empty(len(logprob_rows), 0)
                sampled.top_indices = torch.empty(len(logprob_rows), 0, dtype=torch.long, device=logits.device)
            chosen = token_ids.index_select(0, rows)[:, None]
            sampled.chosen_values = raw_logprobs.gather(1, chosen)
            sampled.chosen_ranks = (raw_logprobs > sampled.chosen_values).sum(dim=-1) + 1
            sampled.chosen_values = sampled.chosen_values.squeeze(1)
        return sampled

    def _exponential_noise(self, probs: torch.Tensor, generators: list) -> torch.Tensor:
        """One Exp(1) draw per token of ``probs``' rows; seeded rows draw on the CPU from their own
        generator so the numbers don't depend on the device or the batch."""
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            if len(unseeded) == len(generators):
                noise.exponential_(generator=self._device_generator(probs.device))
            else:
                rows = to_device(unseeded, torch.long, probs.device)
                noise[rows] = torch.empty(len(unseeded), probs.shape[1], device=probs.device, dtype=probs.dtype
                                          ).exponential_(generator=self._device_generator(probs.device))
        for row, generator in enumerate(generators):
            if generator is not None:
                row_noise = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=generator)
                if probs.device.type == "cuda":
                    row_noise = row_noise.pin_memory()
                noise[row].copy_(row_noise, non_blocking=True)
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

    def _choose(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        chosen = kernels.argmax(logits)
        vocab_size = logits.shape[-1]
        sampled_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        # Rows with top-k/top-p race over their candidates, the others over the whole vocabulary:
        # two calls, each told on the host what applies.
        is_filtered = {i: _top_k_of(requests[i].sampling_params, vocab_size) is not None for i in sampled_rows}
        plain = [i for i in sampled_rows if not is_filtered[i]]
        filtered = [i for i in sampled_rows if is_filtered[i]]
        for rows in (plain, filtered):
            if rows:
                index = to_device(rows, torch.long, logits.device)
                chosen[index] = self._sample(logits.index_select(0, index), [requests[i] for i in rows])
        return chosen

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        device, vocab_size = logits.device, logits.shape[-1]
        options = {}
        top_ks = [_top_k_of(p, vocab_size) for p in params]
        if top_ks[0] is not None:
            options.update(top_ks=to_device([p.top_k for p in params], torch.long, device),
                           top_ps=to_device([p.top_p for p in params], logits.dtype, device),
                           num_candidates=max(top_ks))
        if any(p.min_p > 0 for p in params):
            options["min_ps"] = to_device([p.min_p for p in params], logits.dtype, device)
        generators = [r.generator for r in requests]
        if any(g is not None for g in generators):
            options["noise"] = self._exponential_noise(logits, generators)
        else:
            options["generator"] = self._device_generator(device)
        temperatures = to_device([p.temperature for p in params], logits.dtype, device)
        return kernels.sample_rows(logits, temperatures, **options)


def _top_k_of(params, vocab_size: int) -> int | None:
    """How many candidates a row with top-k or top-p samples from (the vocabulary for top-p
    alone); None for a row with neither."""
    has_top_k = 0 < params.top_k < vocab_size
    if not has_top_k and params.top_p >= 1.0:
        return None
    return params.top_k if has_top_k else vocab_size


def _block_early_stop(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Until min_tokens are out, EOS and stop tokens can't be chosen."""
    rows = [i for i, r in enumerate(requests) if _blocks_early_stop(r)]
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


def _blocks_early_stop(request: Request) -> bool:
    return request.num_output_tokens < request.sampling_params.min_tokens


def _is_plain_greedy(request: Request) -> bool:
    params = request.sampling_params
    return params.is_greedy and params.logprobs is None and request.can_sample_ahead
