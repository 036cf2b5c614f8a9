"""How many of an n-gram match's tokens to propose: as many as pay for their verification.

A verification step of ``1 + L`` rows costs more than a decode step, and how much more depends on
the device: on the CPU at batch 1 (SmolLM2-135M from its Q4_1 GGUF, bf16, 1 thread) the int4
matmul runs rows in blocks of 4, so a fifth row reads and unpacks every weight again
(:data:`CPU_STEP_COSTS`), while in float32 on an AVX2 CPU a second row already costs ~1.3-1.5 decode
steps; so the CPU's costs are measured as the engine runs (:class:`MeasuredStepCosts`). On a GPU a
verify step of 5 rows costs ~1.05 decode steps. Proposing
``L`` tokens whose acceptance probabilities are ``p_1, p_2, ...`` yields ``1 + p_1 + p_1 p_2 + ...``
tokens for ``cost(1 + L)``; :func:`best_length` picks the ``L`` (0 = a plain decode step) with the
most expected tokens per unit of cost.

The probabilities come from :class:`AcceptanceEstimate`: a prior per kind of match (how many
tokens matched, whether earlier occurrences of the n-gram disagree on what came next), measured
on SmolLM2 answers to 21 handbook questions and an invoice extraction that are *not* the
benchmark's prompts, and moved towards what the request's own verified proposals showed.
"""
from __future__ import annotations

# Relative cost of a step of 1, 2, 3, ... rows at batch 1 on the CPU (a decode step = 1). Measured:
# the runner's forward pass plus the sampler for a 1..5-row step of the bundled SmolLM2 (bf16, Q4_1
# int4 kernel, Q8_0 head, 1 thread), medians of interleaved repeats: quiet machine 1.00 / 1.18 /
# 1.29 / 1.44 / 1.89 (wall), loaded 1.00 / 1.06 / 1.22 / 1.38 / 1.72 (CPU time).
# Rows 6-8 stay on the int4 kernel (a second block of 4 rows); from 9 rows the dense path.
CPU_STEP_COSTS = (1.0, 1.12, 1.26, 1.41, 1.80, 1.92, 2.04, 2.16)


def cpu_step_cost(num_rows: int) -> float:
    """:data:`CPU_STEP_COSTS`; past 8 rows (the dense path, not measured) a row costs what rows 6-8
    do, plus a block's extra pass every 4 rows."""
    if num_rows <= len(CPU_STEP_COSTS):
        return CPU_STEP_COSTS[num_rows - 1]
    per_row = CPU_STEP_COSTS[-1] - CPU_STEP_COSTS[-2]
    per_block = CPU_STEP_COSTS[4] - CPU_STEP_COSTS[3] - per_row
    extra = num_rows - len(CPU_STEP_COSTS)
    return CPU_STEP_COSTS[-1] + extra * per_row + -(-extra // 4) * per_block


def step_costs_for(device_type: str):
    """The step costs the n-gram proposer trims its proposals by: on the CPU a
    :class:`MeasuredStepCosts` (this machine's own step times, :func:`cpu_step_cost` until it has
    some), else None (propose the whole match: a GPU verifies k + 1 rows for about the price of one)."""
    return MeasuredStepCosts() if device_type == "cpu" else None


class MeasuredStepCosts:
    """The relative cost of a batch-1 step of so many rows, measured on this machine as the engine
    runs (:meth:`observe`: the forward pass and draws of each one-request decode or verify step).

    Why measured: the cost of extra rows depends on the CPU and the weights' kernels. Measured on
    the bundled SmolLM2 (1 thread, CPU time): bf16 with the int4 kernel (AVX-512/AMX Xeon) 1.00 /
    1.06-1.18 / 1.22-1.29 / 1.38-1.44 / 1.72-1.89 for 1..5 rows; float32 on an AVX2 EPYC (the
    GGUF C kernels, 2 rows per pass of the head) 1.00 / 1.33-1.52 / 1.56-1.81 / 1.88-2.20 / 2.06+.

    A verify step's cost is its time over the median of the latest decode steps (so a shared
    machine's load, which drifts, is the same in both), and a row count's cost the median of its
    recent ratios. A row count not measured yet costs what the nearest measured smaller count
    does (optimistic, so it is tried and then measured: MIN_SAMPLES steps an engine), and with no
    smaller count measured, :func:`cpu_step_cost` (the cheapest extra rows measured, AVX-512 bf16),
    as before decode steps are measured. (With none measured it once cost 1.0: a fresh engine's
    first proposals took whole matches as if verify rows were free, up to 3.3 decode steps a verify
    step on float32. Extrapolating unmeasured counts by the table's growth instead kept a float32
    engine from ever trying 5 rows, which pay on an extraction: 1.60-1.66x against 1.68-1.70x.)

    >>> costs = MeasuredStepCosts()
    >>> for _ in range(8): costs.observe(1, 0.010); costs.observe(3, 0.021)
    >>> costs(1), costs(2), round(costs(3), 6), round(costs(4), 6)
    (1.0, 1.12, 2.1, 2.1)
    """

    # Ratios of a row count before its cost is trusted, how many recent ones are kept, and how
    # many of the latest decode steps a verify step is compared with.
    MIN_SAMPLES = 3
    WINDOW = 32
    NUM_RECENT_DECODES = 5

    __slots__ = ("_decodes", "_ratios", "_costs")

    def __init__(self) -> None:
        self._decodes: list[float] = []              # the latest decode steps' seconds
        self._ratios: dict[int, list[float]] = {}    # rows → recent verify/decode ratios
        self._costs: dict[int, float] = {}           # rows → the median of its ratios

    def observe(self, num_rows: int, seconds: float) -> None:
        """A one-request step of ``num_rows`` rows (1: a decode step) took ``seconds``."""
        if num_rows <= 1:
            self._decodes = self._decodes[1 - self.NUM_RECENT_DECODES:] + [seconds]
            return
        if len(self._decodes) < self.NUM_RECENT_DECODES:
            return
        ratios = self._ratios.setdefault(num_rows, [])
        ratios.append(seconds / max(_median(self._decodes), 1e-12))
        del ratios[:-self.WINDOW]
        if len(ratios) >= self.MIN_SAMPLES:
            self._costs[num_rows] = max(1.0, _median(ratios))

    def __call__(self, num_rows: int) -> float:
        if num_rows <= 1:
            return 1.0
        if len(self._decodes) < self.NUM_RECENT_DECODES:
            return cpu_step_cost(num_rows)
        measured = [rows for rows in self._costs if rows <= num_rows]
        return self._costs[max(measured)] if measured else cpu_step_cost(num_rows)

    def measured(self) -> dict[int, float]:
        """``{rows: cost}`` for each row count measured so far (for benchmarks and logs)."""
        return {} if not self._decodes else {1: 1.0, **dict(sorted(self._costs.items()))}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def best_length(probabilities: list[float], step_cost, min_gain: float = 0.0) -> int:
    """The proposal length ``L`` (0 .. len(probabilities)) with the most expected tokens per unit
    of step cost; ``probabilities[j]``: the chance token ``j`` is accepted given those before were.
    With ``min_gain`` a proposal must promise that much more than a plain decode step (0.1: 10 %
    more tokens per unit of cost), else 0.

    >>> best_length([0.9, 0.9, 0.9, 0.9], cpu_step_cost)   # a 5th row: another pass of the weights
    3
    >>> best_length([0.1, 0.9], cpu_step_cost)    # unlikely first token: a plain decode step
    0
    >>> best_length([0.2], cpu_step_cost), best_length([0.2], cpu_step_cost, min_gain=0.1)
    (1, 0)
    """
    best, best_rate = 0, (1.0 + min_gain) / step_cost(1)
    expected, chance = 1.0, 1.0
    for length, probability in enumerate(probabilities, start=1):
        chance *= probability
        expected += chance
        rate = expected / step_cost(1 + length)
        if rate > best_rate:
            best, best_rate = length, rate
    return best


# Acceptance of a proposal's first token by (matched n-gram length, earlier occurrences disagree on
# the next token), and of each later token given the ones before it were accepted, by matched
# length. Measured on SmolLM2 (bf16, greedy) answers to 21 handbook questions and an invoice
# extraction, none of them the benchmark's prompts (e.g. first token after a 1-token match whose
# occurrences disagree: 19 of 139 accepted; after a 4-token match: 287 of 336).
FIRST_TOKEN_PRIOR = {(1, False): 0.40, (1, True): 0.14, (2, False): 0.67, (2, True): 0.09,
                     (3, False): 0.86, (3, True): 0.50, (4, False): 0.85, (4, True): 0.52}
LATER_TOKEN_PRIOR = {1: 0.65, 2: 0.75, 3: 0.75, 4: 0.90}
# How many verified tokens the prior weighs as: a request's own outcomes take over after a few steps.
PRIOR_WEIGHT = 4.0
# The gain a proposal must promise over a decode step (best_length's min_gain): the estimates are
# rough, and at the break-even a proposal earns nothing while a misjudged one loses.
MIN_GAIN = 0.10
# Steps without proposals after a miss that left the request's balance negative; doubled at each
# such miss, up to MAX_PAUSE; the first proposal after a pause (the re-probe) is one token.
# Chosen on an offline replay of 22 SmolLM2 answers (the bench's, and 16 other handbook questions)
# at four measured cost tables (bf16 and float32 engines): against no guard, the worst answer at
# float32 0.92x -> 0.97x, the bf16 geometric mean 1.455x -> 1.434x.
FIRST_PAUSE, MAX_PAUSE = 2, 16
PROBE_LENGTH = 1
# Outright rejections in a row that pause proposals (while the balance is negative); 2 kept rag 3
# (misses and hits alternate) below 1x at float32.
PAUSE_AFTER_MISSES = 1


class AcceptanceEstimate:
    """One request's acceptance probabilities per kind of proposal token, from the prior and the
    request's verified proposals, and its speculation balance.

    The balance (:attr:`net`) is what the request's speculation has earned so far, in decode steps:
    accepted tokens minus each verify step's cost over a decode step's. A proposal rejected
    outright while the balance is negative pauses proposals for a few steps (:attr:`idle`), each
    such pause twice the last, and the proposal after a pause is one
    token (a cheap re-probe); an accepted token ends the probing, and the pauses start short again
    once the balance is back above zero. So a request whose matches keep missing spends little on
    them, whatever the prior promised.

    >>> estimate = AcceptanceEstimate()
    >>> estimate.probabilities(match_length=2, is_ambiguous=False, num_tokens=3)
    [0.67, 0.75, 0.75]
    >>> estimate.record(estimate.kinds(2, False, 1), num_accepted=0, extra_cost=0.3)
    >>> estimate.net, estimate.idle, estimate.is_probing
    (-0.3, 2, True)
    """

    __slots__ = ("counts", "net", "idle", "pause", "is_probing", "misses")

    def __init__(self) -> None:
        self.counts: dict[tuple, list[float]] = {}   # kind → [accepted, verified]
        self.net = 0.0              # accepted tokens minus verify steps' extra cost, in decode steps
        self.idle = 0               # steps left without proposals
        self.pause = FIRST_PAUSE    # the next pause's length
        self.is_probing = False     # after a pause: one-token proposals until one is accepted
        self.misses = 0             # proposals rejected outright in a row

    @staticmethod
    def kinds(match_length: int, is_ambiguous: bool, num_tokens: int) -> list[tuple]:
        """The kind of each of a proposal's tokens."""
        bucket = min(match_length, 4)
        return [("first", bucket, is_ambiguous)] + [("later", bucket)] * (num_tokens - 1)

    def probabilities(self, match_length: int, is_ambiguous: bool, num_tokens: int) -> list[float]:
        return [self._rate(kind) for kind in self.kinds(match_length, is_ambiguous, num_tokens)]

    def record(self, kinds: list[tuple], num_accepted: int, extra_cost: float = 0.0) -> None:
        """A verified proposal of ``len(kinds)`` tokens whose first ``num_accepted`` were accepted
        (the tokens after the first rejected one were not tested), in a step that cost
        ``extra_cost`` decode steps more than a decode step."""
        for position, kind in enumerate(kinds[:num_accepted + 1]):
            count = self.counts.setdefault(kind, [0.0, 0.0])
            count[0] += position < num_accepted
            count[1] += 1
        self.net += num_accepted - extra_cost
        self.misses = 0 if num_accepted else self.misses + 1
        if num_accepted:
            self.is_probing = False
            if self.net >= 0:
                self.pause = FIRST_PAUSE
        elif self.net < 0 and (self.misses >= PAUSE_AFTER_MISSES or self.is_probing):
            self.idle, self.pause, self.is_probing = self.pause, min(2 * self.pause, MAX_PAUSE), True

    def _rate(self, kind: tuple) -> float:
        accepted, verified = self.counts.get(kind, (0.0, 0.0))
        return (_prior(kind) * PRIOR_WEIGHT + accepted) / (PRIOR_WEIGHT + verified)


def _prior(kind: tuple) -> float:
    return FIRST_TOKEN_PRIOR[kind[1:]] if kind[0] == "first" else LATER_TOKEN_PRIOR[kind[1]]
