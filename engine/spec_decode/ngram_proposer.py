"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's
last n tokens. RAG and extraction answers copy spans of their context, so this often guesses
several tokens right with no second model.

Short matches are cheap to find and often right, but a proposal that misses still costs a
verification step of ``1 + k`` rows, which on a CPU is far dearer than a decode step (SmolLM2, 1
thread: ~1.3-1.5x at k=4). So with ``backoff`` (off by default) a request whose last verified
proposal was rejected outright needs a match one token longer for its next proposal; one accepted
proposal token lifts that again. A step with no proposal is an ordinary decode step.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposals from the sequence itself (prompt and output so far).

    >>> NgramProposer(min_n=2, max_n=3).propose_one([5, 6, 7, 8, 5, 6], max_num_tokens=2)
    [7, 8]

    ``backoff`` (``speculative.prompt_lookup_backoff``): after a verification step that accepted
    none of a request's proposals, its next proposal needs an n-gram of at least ``min_n + 1``
    tokens (at most ``max_n``) until one of its proposal tokens is accepted again.
    """

    def __init__(self, min_n: int, max_n: int, backoff: bool = False) -> None:
        self.min_n, self.max_n, self.backoff = min_n, max_n, backoff
        # request id → (the request, its token count when proposed, the proposal, backed off?)
        self._last: dict[str, tuple[object, int, list[int], bool]] = {}

    def propose(self, requests, max_num_tokens: list[int]) -> list[list[int]]:
        """One proposal (possibly empty) per request, each at most its ``max_num_tokens`` long."""
        if not self.backoff:
            return [self.propose_one(r.token_ids, k) for r, k in zip(requests, max_num_tokens)]
        proposals = []
        for request, k in zip(requests, max_num_tokens):
            backed_off = self._is_backed_off(request)
            min_n = min(self.min_n + 1, self.max_n) if backed_off else self.min_n
            proposal = self.propose_one(request.token_ids, k, min_n)
            self._last[request.request_id] = (request, len(request.token_ids), proposal, backed_off)
            proposals.append(proposal)
        return proposals

    def propose_one(self, token_ids: list[int], max_num_tokens: int, min_n: int | None = None) -> list[int]:
        if max_num_tokens <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(self.max_n, (self.min_n if min_n is None else min_n) - 1, -1):
            if len(tokens) <= n:
                continue
            # Windows start at 0 .. len-1-n: each is followed by at least one token, and the
            # suffix itself (starting at len-n) is not among them.
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start:start + max_num_tokens].tolist()
        return []

    def _is_backed_off(self, request) -> bool:
        """Whether ``request``'s last verified proposal missed (kept while it proposes nothing)."""
        entry = self._last.get(request.request_id)
        if entry is None or entry[0] is not request:  # new, or an id reused after its request finished
            return False
        _, num_tokens, proposal, backed_off = entry
        if not proposal or len(request.token_ids) <= num_tokens:  # nothing verified since
            return backed_off
        return request.token_ids[num_tokens] != proposal[0]

    def forget_finished(self) -> None:
        """Drop what is kept of requests that have finished (or been aborted)."""
        for request_id in [i for i, entry in self._last.items() if entry[0].is_finished]:
            del self._last[request_id]
