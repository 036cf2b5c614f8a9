"""Which texts run together: a step takes a fair share of every waiting request, then its texts
are sorted by length and cut into batches, so that short texts are not padded to long ones."""
from __future__ import annotations


def plan_batches(lengths: list[int], max_batch_tokens: int, max_batch_size: int,
                 split_below: int = 0) -> list[list[int]]:
    """Indices into ``lengths``, grouped into batches, longest texts first.

    A batch costs its padded size, ``len(batch) * longest``, which stays within ``max_batch_tokens``
    (a single text longer than that runs alone) and holds at most ``max_batch_size`` texts. Texts
    shorter than ``split_below`` never share a batch with longer ones (a mixed-precision encoder
    runs such batches in float32, and a text's embedding must not depend on its batch mates).

    >>> plan_batches([3, 10, 4, 9], max_batch_tokens=20, max_batch_size=8)
    [[1, 3], [2, 0]]
    >>> plan_batches([3, 10, 4, 9], max_batch_tokens=20, max_batch_size=8, split_below=4)
    [[1, 3], [2], [0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    batch: list[int] = []
    for index in order:
        if batch and _is_closed(batch, lengths, index, max_batch_tokens, max_batch_size, split_below):
            batches.append(batch)
            batch = []
        batch.append(index)
    if batch:
        batches.append(batch)
    return batches


def _is_closed(batch: list[int], lengths: list[int], next_index: int, max_batch_tokens: int, max_batch_size: int,
               split_below: int) -> bool:
    """Whether ``batch`` (non-empty, longest first) must end before the text at ``next_index``."""
    is_full = len(batch) == max_batch_size or (len(batch) + 1) * lengths[batch[0]] > max_batch_tokens
    return is_full or lengths[next_index] < split_below <= lengths[batch[-1]]


def fair_shares(num_remaining: list[int], budget: int) -> list[int]:
    """How many texts each waiting request (oldest first) gives to the next step of ``budget`` texts.

    Every request gets an equal share and unused shares go to those with more, so a short query
    that arrives behind a large corpus waits for one step, not for the whole corpus.

    >>> fair_shares([1000, 1, 5], budget=64)
    [58, 1, 5]
    """
    shares = [0] * len(num_remaining)
    left = budget
    while left > 0:
        wanting = [i for i, remaining in enumerate(num_remaining) if remaining > shares[i]]
        if not wanting:
            break
        each = max(1, left // len(wanting))
        for i in wanting:
            take = min(each, num_remaining[i] - shares[i], left)
            shares[i] += take
            left -= take
            if left == 0:
                break
    return shares
