"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's
last n tokens. RAG and extraction answers copy spans of their context, so this often guesses
several tokens right with no second model."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposals from the sequence itself (prompt and output so far).

    >>> NgramProposer(min_n=2, max_n=3).propose_one([5, 6, 7, 8, 5, 6], max_num_tokens=2)
    [7, 8]
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.lengths = range(max_n, min_n - 1, -1)

    def propose(self, requests, max_num_tokens: list[int]) -> list[list[int]]:
        """One proposal (possibly empty) per request, each at most its ``max_num_tokens`` long."""
        return [self.propose_one(r.token_ids, k) for r, k in zip(requests, max_num_tokens)]

    def propose_one(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        if max_num_tokens <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in self.lengths:
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

    def forget_finished(self) -> None:
        """Nothing held per request."""
