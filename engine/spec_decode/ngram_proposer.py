"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's
last n tokens. RAG and extraction answers copy spans of their context, so this often guesses
several tokens right with no second model.

A proposal that misses still costs a verification step of ``1 + L`` rows, which on a CPU is far
dearer than a decode step. So where the engine gives it the device's step costs (the CPU: see
:mod:`.proposal_lengths`), the proposer keeps only as many of the match's tokens as pay for
their verification, judged by how often such matches were accepted (a prior, then the request's
own verified proposals): a weak match (one token whose earlier occurrences disagree) usually
proposes nothing, a long one up to ``k``; a proposal must promise 10 % more tokens per unit of cost
than a decode step (``proposal_lengths.MIN_GAIN``), and a request whose proposals keep missing
while its speculation is in the red pauses them, then re-probes with one token
(:class:`.AcceptanceEstimate`). With ``backoff`` (off by default) a request whose last
verified proposal was rejected outright needs a match one token longer for its next proposal;
one accepted proposal token lifts that again. A step with no proposal is an ordinary decode step.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import proposal_lengths
from .proposal_lengths import AcceptanceEstimate, best_length


@dataclass(slots=True)
class Match:
    """The latest earlier occurrence of the sequence's last ``length`` tokens: what followed it
    starts at ``start``; ``is_ambiguous``: other occurrences were followed by another token."""

    length: int
    start: int
    is_ambiguous: bool


@dataclass(slots=True)
class _Sent:
    """What was proposed to a request, kept to learn from its fate at the next proposal."""

    request: object
    num_tokens: int           # the request's token count when proposed
    proposal: list[int]
    is_backed_off: bool
    kinds: list[tuple]        # each proposal token's kind (AcceptanceEstimate)
    estimate: AcceptanceEstimate | None
    is_counted: bool = False  # its fate already recorded in the estimate


class NgramProposer:
    """Proposals from the sequence itself (prompt and output so far).

    >>> NgramProposer(min_n=2, max_n=3).propose_one([5, 6, 7, 8, 5, 6], max_num_tokens=2)
    [7, 8]

    ``backoff`` (``speculative.prompt_lookup_backoff``): after a verification step that accepted
    none of a request's proposals, its next proposal needs an n-gram of at least ``min_n + 1``
    tokens (at most ``max_n``) until one of its proposal tokens is accepted again.
    ``step_cost`` (``proposal_lengths.step_costs_for(device)``; None: propose whole matches): the
    relative cost of a step of so many rows, by which proposals are trimmed (:func:`best_length`).
    """

    def __init__(self, min_n: int, max_n: int, backoff: bool = False, step_cost=None) -> None:
        self.min_n, self.max_n, self.backoff, self.step_cost = min_n, max_n, backoff, step_cost
        self._sent: dict[str, _Sent] = {}   # request id → its last proposal

    def propose(self, requests, max_num_tokens: list[int]) -> list[list[int]]:
        """One proposal (possibly empty) per request, each at most its ``max_num_tokens`` long."""
        if not self.backoff and self.step_cost is None:
            return [self.propose_one(r.token_ids, k) for r, k in zip(requests, max_num_tokens)]
        return [self._propose_tracked(request, k) for request, k in zip(requests, max_num_tokens)]

    def propose_one(self, token_ids: list[int], max_num_tokens: int, min_n: int | None = None) -> list[int]:
        """The whole match's continuation, at most ``max_num_tokens`` long (no trimming by cost)."""
        match = self.find_match(token_ids, self.min_n if min_n is None else min_n) if max_num_tokens > 0 else None
        return [] if match is None else list(token_ids[match.start:match.start + max_num_tokens])

    def find_match(self, token_ids: list[int], min_n: int | None = None) -> Match | None:
        """The longest n-gram (``max_n`` down to ``min_n``) ending the sequence that occurred before,
        at its latest occurrence.

        Each earlier occurrence of the last token is extended backwards (up to ``max_n`` tokens) in
        plain Python: in the engine, between forward passes that stream the weights through the
        caches, this took 18 µs a step on the bench's prompts against 270 for numpy windows over the
        whole sequence (SmolLM2 bench spec, AVX-512 EPYC, 1 thread), a step paid whether or not
        anything is proposed."""
        min_n = self.min_n if min_n is None else min_n
        if not isinstance(token_ids, (list, tuple)):
            token_ids = list(token_ids)
        size = len(token_ids)
        if size <= min_n:
            return None
        last, limit = token_ids[-1], min(self.max_n, size - 1)
        best, best_end, ends = 0, -1, []
        end = -1
        while True:
            try:  # the next occurrence of the last token before it (the suffix itself is not one)
                end = token_ids.index(last, end + 1, size - 1)
            except ValueError:
                break
            length = 1
            while length < limit and end >= length and token_ids[end - length] == token_ids[size - 1 - length]:
                length += 1
            ends.append((end, length))
            if length >= best:
                best, best_end = length, end
        if best < min_n:
            return None
        follows = token_ids[best_end + 1]
        return Match(best, best_end + 1, any(length >= best and token_ids[end + 1] != follows for end, length in ends))

    def _propose_tracked(self, request, max_num_tokens: int) -> list[int]:
        sent = self._sent.get(request.request_id)
        if sent is not None and sent.request is not request:  # an id reused after its request finished
            sent = None
        backed_off = self.backoff and self._is_backed_off(request, sent)
        estimate = self._learn(sent) if self.step_cost is not None else None
        min_n = min(self.min_n + 1, self.max_n) if backed_off else self.min_n
        match = None
        if estimate is not None and estimate.idle > 0:  # paused after misses (AcceptanceEstimate)
            estimate.idle -= 1
        elif max_num_tokens > 0:
            match = self.find_match(request.token_ids, min_n)
        proposal, kinds = [], []
        if match is not None:
            proposal = list(request.token_ids[match.start:match.start + max_num_tokens])
            if estimate is not None:
                del proposal[proposal_lengths.PROBE_LENGTH if estimate.is_probing else len(proposal):]
                probabilities = estimate.probabilities(match.length, match.is_ambiguous, len(proposal))
                del proposal[best_length(probabilities, self.step_cost, proposal_lengths.MIN_GAIN):]
                kinds = estimate.kinds(match.length, match.is_ambiguous, len(proposal))
        self._sent[request.request_id] = _Sent(request, len(request.token_ids), proposal, backed_off, kinds, estimate)
        return proposal

    def _learn(self, sent: _Sent | None) -> AcceptanceEstimate:
        """The request's estimate, with its last proposal's fate counted once it is known."""
        if sent is None or sent.estimate is None:
            return AcceptanceEstimate()
        request, proposal = sent.request, sent.proposal
        if proposal and not sent.is_counted and len(request.token_ids) > sent.num_tokens:
            verified = request.token_ids[sent.num_tokens:sent.num_tokens + len(proposal)]
            num_accepted = 0
            while num_accepted < len(verified) and verified[num_accepted] == proposal[num_accepted]:
                num_accepted += 1
            # the tokens after the first mismatch, and any the step did not reach, were not tested
            extra_cost = self.step_cost(1 + len(proposal)) - self.step_cost(1)
            sent.estimate.record(sent.kinds[:len(verified)], num_accepted, extra_cost)
            sent.is_counted = True
        return sent.estimate

    @staticmethod
    def _is_backed_off(request, sent: _Sent | None) -> bool:
        """Whether ``request``'s last verified proposal missed (kept while it proposes nothing)."""
        if sent is None:  # new, or an id reused after its request finished
            return False
        if not sent.proposal or len(request.token_ids) <= sent.num_tokens:  # nothing verified since
            return sent.is_backed_off
        return request.token_ids[sent.num_tokens] != sent.proposal[0]

    def forget_finished(self) -> None:
        """Drop what is kept of requests that have finished (or been aborted)."""
        for request_id in [i for i, sent in self._sent.items() if sent.request.is_finished]:
            del self._sent[request_id]
