"""Counters of proposals and acceptances, under vLLM's ``spec_decode`` metric names."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    """Running totals over verification steps.

    >>> stats = SpecDecodeStats(num_speculative_tokens=4)
    >>> stats.record(num_proposed=4, num_accepted=2)
    >>> stats.acceptance_rate, stats.mean_acceptance_length
    (0.5, 3.0)
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One request's verification: ``num_accepted`` of its ``num_proposed`` proposals kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals over proposed ones (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: accepted proposals plus the target's own one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
        }
