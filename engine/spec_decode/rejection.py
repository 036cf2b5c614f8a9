"""Which proposed tokens a verification step accepts.

The target model scores ``k`` proposals in one pass and yields ``k + 1`` rows; each row is
sampled with the request's own settings, exactly as a normal decode step would. Row ``j`` is
the target's draw for the position of proposal ``j``, given every proposal before it.

Proposals are one-hot (ngram lookups and the greedy draft propose a single token), so the
standard rejection-sampling rule — accept proposal ``x`` with probability ``min(1, p(x) / q(x))
= p(x)``, else draw from ``max(0, p - q)`` renormalized, i.e. ``p`` without ``x`` — is the same as
drawing ``y ~ p`` and accepting iff ``y == x``, emitting ``y`` at the first mismatch:
``P(y = x) = p(x)`` and ``y`` given ``y != x`` is distributed as ``p`` without ``x``. Under
greedy the rule is "accept while the proposal is the argmax". Either way the output has the
target's distribution, token for token.
"""
from __future__ import annotations


def accepted_tokens(proposals: list[int], sampled: list[int]) -> list[int]:
    """The target's draws up to and including the first one that differs from its proposal.

    >>> accepted_tokens([7, 8, 9], [7, 8, 4, 1])      # proposal 9 rejected; 4 drawn in its place
    [7, 8, 4]
    >>> accepted_tokens([7, 8], [7, 8, 5])            # all accepted, plus the bonus draw
    [7, 8, 5]
    """
    if len(sampled) != len(proposals) + 1:
        raise ValueError(f"sampled must have len(proposals) + 1 = {len(proposals) + 1} rows, got {len(sampled)}")
    for position, (proposed, drawn) in enumerate(zip(proposals, sampled)):
        if proposed != drawn:
            return sampled[:position + 1]
    return list(sampled)
