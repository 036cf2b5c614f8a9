"""One sequence being generated: its tokens, its progress and its KV blocks."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """A sequence's state as the scheduler moves ``num_computed_tokens`` toward ``num_tokens``.

    With ``n > 1`` each sample is its own Request sharing ``group_id``; siblings wait for the
    first one's prompt to be cached, then reuse its blocks through the prefix cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    priority: int = 0
    prompt: str | None = None
    group_id: str | None = None
    sample_index: int = 0
    cache_salt: str | None = None
    # The model's name for how this request's KV was computed (Phi-3 longrope: short or long
    # factors, by its length); part of its block hashes. Set by the scheduler on admission.
    kv_regime: str | None = None
    # The LoRA adapter (an ``engine.lora.LoRAAdapter``) it runs with; None: the base model. Part of
    # its block hashes, so no KV is shared across adapters.
    lora: object | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = 0

    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    waits_for: "Request | None" = None
    generator: torch.Generator | None = None
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    output_text: str = ""
    first_token_time: float | None = None
    grammar_future: object | None = None   # compiling grammar (concurrent.futures.Future)
    grammar_submitted_at: float = 0.0
    matcher: object | None = None          # the grammar's state for this sequence, once compiled
    # Sampled on the device by a step still in flight, not yet in token_ids (async scheduling).
    num_pending_tokens: int = 0
    pending_row: int = -1                  # that token's row in the in-flight step's sampled ids

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        seed = self.sampling_params.seed
        if seed is not None:
            self.generator = torch.Generator().manual_seed((seed + self.sample_index) % 2**63)

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.name

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    def is_at_length_limit(self, max_model_len: int, num_pending_tokens: int = 0) -> bool:
        """Whether its tokens, plus ``num_pending_tokens`` not yet seen, reach ``max_tokens`` or ``max_model_len``."""
        max_tokens = self.sampling_params.max_tokens
        return (max_tokens is not None and self.num_output_tokens + num_pending_tokens >= max_tokens) or \
            self.num_tokens + num_pending_tokens >= max_model_len

    @property
    def can_sample_ahead(self) -> bool:
        """Whether its next token may be drawn before the host has seen its pending one: not when
        a grammar, penalties or min_tokens make the next draw depend on the previous token."""
        params = self.sampling_params
        return (self.grammar_future is None and self.matcher is None and not params.needs_penalties
                and self.num_output_tokens + self.num_pending_tokens >= params.min_tokens)

    @property
    def is_waiting_for_grammar(self) -> bool:
        return self.grammar_future is not None and self.matcher is None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
