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

    A request verifying proposals has them in ``spec_token_ids`` (by batch index): its
    ``num_new_tokens`` is ``1 + len(proposals)``, its last known token followed by them.

    >>> batch = scheduler.schedule()
    >>> batch.num_scheduled_tokens, [r.request_id for r in batch.requests]
    (12, ['a', 'b'])
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)   # batch index → proposals

    def proposals_of(self, index: int) -> list[int]:
        """The proposals the request at ``index`` verifies this step (empty: a plain step)."""
        return self.spec_token_ids.get(index, [])

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(slots=True)
class ForwardOutput:
    """Logits for the rows the sampler needs: one per request whose step ends at its last token,
    ``1 + len(proposals)`` consecutive rows for a request verifying proposals."""

    logits: torch.Tensor                          # [num_sampling_rows, vocab], the model's dtype
    sampling_rows: list[int]                      # batch index of each sampled request, in logits order
    prompt_logits: dict[int, torch.Tensor]        # batch index → [num_new_tokens, vocab] for prompt logprobs
    # Each row's greedy argmax, when a CUDA graph computed it with the logits (cuda_graphs.HEAD_SIZES).
    greedy_token_ids: torch.Tensor | None = None
