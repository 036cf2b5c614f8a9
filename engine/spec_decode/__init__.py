"""Speculative decoding: cheap proposals (n-gram prompt lookup or a draft model) that the target
model verifies k at a time in one forward pass.

The flow: the engine asks a proposer for each decoding request's next tokens, the scheduler
schedules them as extra tokens of that request (``ScheduledBatch.spec_token_ids``), the runner
returns logits for every one of them, the sampler draws each row, :func:`accepted_tokens` keeps
the longest agreeing prefix plus one, and the scheduler rolls the KV of the rest back.

Only the light modules are imported here (the engine config imports this package); the draft
model's proposer is :mod:`.draft_model_proposer`.
"""
from .config import SpeculativeConfig
from .ngram_proposer import NgramProposer
from .proposal_lengths import step_costs_for
from .rejection import accepted_tokens
from .stats import SpecDecodeStats

__all__ = ["SpeculativeConfig", "NgramProposer", "accepted_tokens", "SpecDecodeStats", "step_costs_for"]
