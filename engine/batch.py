"""The scheduler → model runner contract: what one step computes (:class:`ScheduledBatch`) and
what the forward pass hands back (:class:`ForwardOutput`).

The scheduler fills a batch, the runner reads it and returns logits, the sampler turns those into
tokens. Keeping the two types here lets each side change without importing the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .request import Request


@dataclass(slots=True)
class ScheduledBatch:
    """This step's work: each request with how many of its tokens to compute now.

    >>> batch = scheduler.schedule()
    >>> batch.num_scheduled_tokens, [r.request_id for r in batch.requests]
    (12, ['a', 'b'])
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(slots=True)
class ForwardOutput:
    """Logits for the rows the sampler needs: one per request whose step ends at its last token."""

    logits: torch.Tensor                          # [num_sampling_requests, vocab], the model's dtype
    sampling_rows: list[int]                      # index into the batch of each logits row
    prompt_logits: dict[int, torch.Tensor]        # batch index → [num_new_tokens, vocab] for prompt logprobs
