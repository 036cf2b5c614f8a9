"""What speculative decoding the engine runs: ``LLM(..., speculative={...})`` becomes a :class:`SpeculativeConfig`."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """Proposals of ``num_speculative_tokens`` per step, verified by the target model in one pass.

    >>> SpeculativeConfig.coerce({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    >>> SpeculativeConfig.coerce({"method": "draft_model", "model": "/path/to/small", "num_speculative_tokens": 3})

    - ``method``: ``"ngram"`` (prompt lookup: copy what followed the latest earlier occurrence of
      the sequence's last n tokens) or ``"draft_model"`` (a small model sharing the tokenizer
      proposes greedily).
    - ``prompt_lookup_min`` / ``prompt_lookup_max``: the n-gram lengths tried, longest first
      (ngram only). Give one and the other takes its value; neither: 2 and 5.
    - ``prompt_lookup_backoff`` (ngram only, default False): after a verification step that
      accepted none of a request's proposals, its next proposal needs an n-gram one token longer
      than ``prompt_lookup_min``, until a proposal token is accepted again (see
      :class:`.NgramProposer`). Measured on SmolLM2 (bench spec: the demo questions, extraction and
      10 more handbook questions; each policy's steps and proposal lengths, which the engine's
      acceptance matched exactly, priced at the CPU's measured step costs): with
      ``prompt_lookup_min=1`` it keeps short answers whose 1-token matches miss from falling below
      plain decoding (worst question 0.89x -> 0.97x); against 2..4 without it, 1..4 with it took
      fewer steps on 3 of the 4 bench prompts but was a wash over all 14 (4 better, 5 worse), and
      in the engine (CPU, 1 thread, interleaved runs) 2..4 without it was faster on the three RAG
      questions in 4 of 4 runs, so it is not the default.
    - ``adaptive_proposal_length`` (ngram only, default True): on the CPU, propose only as many of
      a match's tokens as pay for their verification (``proposal_lengths.best_length``: expected
      accepted tokens, from how often such matches were accepted, against the measured cost of a
      verify step of so many rows; a weak match proposes nothing; a proposal must promise 10 % over
      a decode step, and a request whose speculation is in the red pauses its proposals after a
      miss, then re-probes with one token: see ``proposal_lengths.AcceptanceEstimate``). ``num_speculative_tokens`` is
      the most it proposes. No effect on a GPU, where verifying k + 1 rows costs about one decode
      step. False: always the whole match, up to ``num_speculative_tokens``.
    - ``model``: the draft's path or hub id (draft_model only); it runs on the target's device
      and dtype with its own KV pool of ``kv_cache_memory`` bytes (default: the runner's default).
    Frozen, so an engine's config stays hashable (engines are shared by config).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    kv_cache_memory: int | str | None = None
    prompt_lookup_backoff: bool | None = None
    adaptive_proposal_length: bool | None = None

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def coerce(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, or a dict of its fields (unknown keys raise ValueError)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a dict or None, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    @property
    def ngram_lengths(self) -> range:
        """The n-gram lengths to try, longest first."""
        return range(self.prompt_lookup_max, self.prompt_lookup_min - 1, -1)

    def _check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {list(METHODS)}, got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.method == "ngram":
            self._fill_lookup_range()
            backoff = False if self.prompt_lookup_backoff is None else self.prompt_lookup_backoff
            if not isinstance(backoff, bool):
                raise ValueError(f"speculative.prompt_lookup_backoff must be True or False, got {backoff!r}")
            object.__setattr__(self, "prompt_lookup_backoff", backoff)
            adaptive = True if self.adaptive_proposal_length is None else self.adaptive_proposal_length
            if not isinstance(adaptive, bool):
                raise ValueError(f"speculative.adaptive_proposal_length must be True or False, got {adaptive!r}")
            object.__setattr__(self, "adaptive_proposal_length", adaptive)
            if self.model is not None:
                raise ValueError("speculative.model is for method 'draft_model', not 'ngram'")
        else:
            if (self.prompt_lookup_min is not None or self.prompt_lookup_max is not None
                    or self.prompt_lookup_backoff is not None):
                raise ValueError("speculative.prompt_lookup_min/max/backoff are for method 'ngram', not 'draft_model'")
            if self.adaptive_proposal_length is not None:
                raise ValueError("speculative.adaptive_proposal_length is for method 'ngram', not 'draft_model'")
            if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
                raise ValueError(f"speculative.model must name the draft model for 'draft_model', got {self.model!r}")
            object.__setattr__(self, "model", str(self.model))
        if self.kv_cache_memory is not None:
            from ..config import parse_bytes

            object.__setattr__(self, "kv_cache_memory", parse_bytes("speculative.kv_cache_memory",
                                                                    self.kv_cache_memory))

    def _fill_lookup_range(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low, high = 2, 5
        low = high if low is None else low
        high = low if high is None else high
        _check_int("prompt_lookup_min", low, 1, None)
        _check_int("prompt_lookup_max", high, low, None)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"speculative.{name} must be an int {allowed}, got {value!r}")
