"""How many CPU threads each step runs on: the count measured fastest for steps of its size.

A decode step of a small model is ~150 short parallel regions, and with two OpenMP threads each one
ends in a barrier that is quick only while the idle thread spins. libgomp stops spinning (100 spins
instead of 300,000) once the process holds more OpenMP threads than cores — which it does as soon as
any other thread of the process has run a parallel torch op: the caller's notebook, HF transformers
next to us — and a core lent to another process stalls every barrier too. Measured on this 2-core
machine, SmolLM2-135M: one stream decodes at 72 tok/s on 2 threads, at 40–46 once the main thread
had run a second of torch matmuls, and at 57 on 1 thread either way; prefill and 32-stream decode
stay faster on 2 threads in both states (1011–1071 vs 622–666 and 409–443 vs 260–305 tok/s).

Neither condition can be read from inside the process, so :class:`ThreadGovernor` measures: for
each step size (tokens, by powers of two) it keeps the last few step times of every candidate
count, runs the fastest, and re-times the others every ``RETIME_EVERY`` steps of that size.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ThreadGovernor:
    """Chooses torch's intra-op thread count per step on the thread that runs the steps.

    >>> governor = ThreadGovernor(max_threads=2)
    >>> with governor.threads_for(num_tokens=1):
    ...     run_one_step()              # on 1 or 2 threads, timed
    """

    # Steps of one size between re-timings of the counts not in use: exploring costs a step at the
    # slower count each time, ~1 % at these rates, and conditions (another process, another
    # OpenMP team in this one) change over seconds, not steps.
    RETIME_EVERY = 48
    # Each count's time is the median of its last few steps, so one slow step (a first use of a
    # shape, a page fault, a preemption) does not decide.
    NUM_TIMINGS = 3

    def __init__(self, max_threads: int) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        self.max_threads = max_threads
        self.candidates = sorted({1, max(1, max_threads // 2), max_threads})
        self._timings: dict[int, dict[int, deque]] = defaultdict(dict)   # size bucket → count → seconds
        self._num_steps: dict[int, int] = defaultdict(int)

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of ``num_tokens`` tokens."""
        bucket = num_tokens.bit_length()
        timings = self._timings.get(bucket, {})
        # all threads first, as without a governor: a size seen once (one long prompt) runs as before
        untimed = [count for count in reversed(self.candidates) if count not in timings]
        if untimed:
            return untimed[0]
        best = min(timings, key=lambda count: statistics.median(timings[count]))
        step = self._num_steps.get(bucket, 0)
        if step % self.RETIME_EVERY == self.RETIME_EVERY - 1:
            others = [count for count in self.candidates if count != best]
            return others[(step // self.RETIME_EVERY) % len(others)]
        return best

    def record(self, num_tokens: int, num_threads: int, seconds: float) -> None:
        bucket = num_tokens.bit_length()
        self._timings[bucket].setdefault(num_threads, deque(maxlen=self.NUM_TIMINGS)).append(seconds)
        self._num_steps[bucket] += 1

    @contextmanager
    def threads_for(self, num_tokens: int) -> Iterator[int]:
        """Run the body on the chosen count and time it; torch's count is ``max_threads`` again
        afterwards (``torch.set_num_threads`` also sets the count threads started later begin with)."""
        num_threads = self.choose(num_tokens)
        if num_threads != self.max_threads:
            torch.set_num_threads(num_threads)
        started = time.perf_counter()
        try:
            yield num_threads
        finally:
            seconds = time.perf_counter() - started
            if num_threads != self.max_threads:
                torch.set_num_threads(self.max_threads)
        self.record(num_tokens, num_threads, seconds)

    def summary(self) -> dict[int, dict[int, float]]:
        """Median step seconds per size bucket (``2**(b-1)`` to ``2**b - 1`` tokens) and count."""
        return {bucket: {count: statistics.median(times) for count, times in sorted(timings.items())}
                for bucket, timings in sorted(self._timings.items())}
