"""How one request is sampled, validated field by field before the engine sees it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings for one request.

    >>> SamplingParams(temperature=0.0, max_tokens=32)          # greedy
    >>> SamplingParams(temperature=0.8, top_p=0.95, seed=7, n=2, stop=["\\n\\n"])

    ``temperature=0`` is greedy. ``top_k`` of 0 or -1 means off. ``seed`` makes a request's
    samples the same alone or in any batch. ``logprobs=N`` returns the top-N log-probabilities
    of each generated token (plus the sampled one); ``prompt_logprobs=N`` does so for the prompt.
    ``max_tokens=None`` generates until EOS, a stop or the end of the context; a number larger than
    the context leaves for the prompt is refused when the request is added (``ValueError``).
    ``detokenize=False`` returns token ids only (no text, no stop strings), for throughput runs.
    ``speculative=False`` keeps this request out of speculative decoding when the engine runs it.
    Invalid values raise ``ValueError`` naming the field and its allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_output: object | None = None
    speculative: bool = True
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self.stop_strings = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        if self.structured_output is not None:
            from .structured_output import StructuredOutput

            self.structured_output = StructuredOutput.coerce(self.structured_output)
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, 2.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1, None)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        if self.max_tokens is not None:  # None: until EOS, a stop or the end of the context
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, None)
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be True or False, got {self.speculative!r}")


def _normalize_stop(stop: list[str] | str | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if not isinstance(stop, (str, list, tuple)):
        raise ValueError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    strings = [stop] if isinstance(stop, str) else list(stop)
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}")
    for text in strings:
        if not isinstance(text, str) or not text:
            raise ValueError(f"stop: every stop string must be a non-empty str, got {text!r}")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop: a stop string may have at most {MAX_STOP_STRING_CHARS} characters")
    return tuple(strings)


def _normalize_stop_token_ids(token_ids) -> list[int]:
    if token_ids is None:
        return []
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of ints, got {type(token_ids).__name__}")
    return list(token_ids)


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")
