"""What the engine hands back to callers."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (``n`` of them when ``SamplingParams.n > 1``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt.

    >>> out = llm.generate("Hello")[0]
    >>> out.outputs[0].text, out.num_cached_tokens
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    metrics: dict = field(default_factory=dict)
    lora_name: str | None = None          # the LoRA adapter that answered; None: the base model


@dataclass(slots=True)
class Usage:
    """Token counts of a finished request; ``cached_tokens`` of the prompt came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class StreamOutput:
    """What one engine step produced for one request (one sample of it when ``n > 1``).

    ``finish_reason`` is set on a sample's last output; ``finished``, ``usage``, the prompt's
    token ids and text (a ``ChatPrompt`` as its template rendered it; None for token ids), and
    ``prompt_logprobs`` when asked, only on the request's very last output.
    """

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    index: int = 0
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finished: bool = False
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt: str | None = None
    lora_name: str | None = None          # on the last output: the LoRA adapter that answered
