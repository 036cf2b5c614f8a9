"""Beam search above the engine, as vLLM's ``LLM.beam_search`` does it: each step sends every live
beam as a prompt for one token with its ``2 * beam_width`` best log-probabilities; the prefix cache
holds the beams' shared prompt and earlier tokens, so a step prefills only each beam's last block.

The selection follows HF transformers' ``generate(num_beams=..., do_sample=False)`` (its default
``early_stopping=False``): each step keeps the ``2 * beam_width`` best continuations over all beams;
of those, the ones that end (EOS, or the last allowed token) and rank in the top ``beam_width``
become finished hypotheses scored ``cum_logprob / generated_len ** length_penalty``; the best
``beam_width`` others run on. The search stops when no running beam can beat the worst of
``beam_width`` finished ones, or at ``max_tokens``.

>>> llm = LLM("default")
>>> [out] = llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=4, max_tokens=8))
>>> out.sequences[0].text, out.sequences[0].score
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(slots=True)
class BeamSearchParams:
    """How to search.

    >>> BeamSearchParams(beam_width=4, max_tokens=32, length_penalty=1.0)

    ``length_penalty`` divides a finished beam's log-probability by its length to that power (HF's
    meaning): above 0 favours longer answers. ``ignore_eos`` runs every beam to ``max_tokens``.
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        max_width = MAX_LOGPROBS // 2  # each step asks for 2 * beam_width log-probabilities
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or \
                not 1 <= self.beam_width <= max_width:
            raise ValueError(f"beam_width must be an int in [1, {max_width}], got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) or \
                not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam: its generated tokens (EOS included when it ended there), their summed
    log-probability and its length-penalized score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    text: str = ""
    finish_reason: str = "length"  # "stop" when it ended with EOS


@dataclass(slots=True)
class BeamSearchOutput:
    """The ``beam_width`` best sequences for one prompt, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass(slots=True)
class _Beam:
    token_ids: list[int]
    cum_logprob: float


class _Search:
    """The search state of one prompt (plain state; the engine calls are in :func:`beam_search`)."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int]):
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.running = [_Beam([], 0.0)]
        self.finished: list[tuple[float, _Beam]] = []
        self.can_improve = True
        self.num_steps = 0

    @property
    def is_done(self) -> bool:
        return not self.can_improve or not self.running or self.num_steps == self.params.max_tokens

    def prompts(self) -> list[list[int]]:
        return [self.prompt_token_ids + beam.token_ids for beam in self.running]

    def advance(self, top_logprobs: list[list[tuple[int, float]]]) -> None:
        """One step: ``top_logprobs[i]`` holds beam i's best (token, logprob) continuations."""
        width = self.params.beam_width
        self.num_steps += 1
        is_last = self.num_steps == self.params.max_tokens
        candidates = sorted(((beam.cum_logprob + logprob, beam.token_ids + [token])
                             for beam, entries in zip(self.running, top_logprobs) for token, logprob in entries),
                            key=lambda candidate: -candidate[0])[:2 * width]
        ends = [is_last or tokens[-1] in self.eos_token_ids for _, tokens in candidates]
        if self.can_improve:
            for (cum_logprob, tokens), has_ended in zip(candidates[:width], ends):
                if has_ended:
                    self.finished.append((self._score(cum_logprob), _Beam(tokens, cum_logprob)))
            self.finished = sorted(self.finished, key=lambda item: -item[0])[:width]
        self.running = [_Beam(tokens, cum_logprob) for (cum_logprob, tokens), has_ended in zip(candidates, ends)
                        if not has_ended][:width]
        self.can_improve = self.can_improve and self._running_may_beat_finished()

    def _score(self, cum_logprob: float) -> float:
        return cum_logprob / (self.num_steps ** self.params.length_penalty)

    def _running_may_beat_finished(self) -> bool:
        """HF's heuristic for early_stopping=False: the best running beam, scored at its current length."""
        if len(self.finished) < self.params.beam_width:
            return True
        if not self.running:
            return False
        return self._score(self.running[0].cum_logprob) > self.finished[-1][0]

    def output(self, tokenizer) -> BeamSearchOutput:
        sequences = [BeamSearchSequence(beam.token_ids, beam.cum_logprob, score,
                                        tokenizer.decode(beam.token_ids, skip_special_tokens=True),
                                        "stop" if beam.token_ids and beam.token_ids[-1] in self.eos_token_ids
                                        else "length")
                     for score, beam in self.finished]
        return BeamSearchOutput(self.prompt_token_ids, sequences)


def beam_search(core, prompts: list[str | list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt (text or token ids) on ``core`` (an :class:`EngineCore`); all
    prompts' beams go to the engine together, one step at a time."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    tokenizer = core.tokenizer
    searches = [_Search(prompt if isinstance(prompt, list) else tokenizer.encode(prompt), params,
                        core.model_info.eos_token_ids) for prompt in prompts]
    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True,
                          detokenize=False)
    while active := [search for search in searches if not search.is_done]:
        batch = [prompt for search in active for prompt in search.prompts()]
        streams = core.add_requests(batch, [step] * len(batch))
        tops = [_top_logprobs(stream, 2 * params.beam_width) for stream in streams]
        start = 0
        for search in active:
            num_beams = len(search.running)
            search.advance(tops[start:start + num_beams])
            start += num_beams
    return [search.output(tokenizer) for search in searches]


def _top_logprobs(stream, num: int) -> list[tuple[int, float]]:
    """The ``num`` best (token, logprob) of a one-token request, best first."""
    entries = {}
    for output in stream:
        for step in output.logprobs or []:
            entries.update(step)
    return [(token, entry.logprob) for token, entry in sorted(entries.items(), key=lambda item: item[1].rank)
            if entry.rank <= num]
