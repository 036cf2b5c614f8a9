"""Engine metrics under vLLM's names, exported through prometheus_client when it is installed
(``pip install hearth-llm[metrics]``), and a periodic log line.

>>> from hearth_llm.engine.metrics import start_metrics_server
>>> start_metrics_server(8000)          # http://127.0.0.1:8000/metrics
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("hearth_llm")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


@dataclass(slots=True)
class StepStats:
    """One step's numbers for the metrics: what it produced and the engine's state after it.

    >>> StepStats.collect(deltas, engine.stats()).num_new_tokens
    4
    """

    now: float
    num_new_tokens: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float                   # 1 = every block in use
    prefix_cache_queries: int               # running totals, as the engine counts them
    prefix_cache_hits: int
    num_preemptions: int
    # speculative decoding's running totals (None: off): drafts, draft tokens, accepted tokens, accepted per position
    spec_decode: SpecDecodeTotals | None = None
    first_token_latencies: list[float] = field(default_factory=list)   # arrival → first token, this step's
    request_latencies: list[float] = field(default_factory=list)       # arrival → finish, per finished sequence
    time_per_output_token: list[float] = field(default_factory=list)   # after the first, finished sequences

    @classmethod
    def collect(cls, deltas, engine_stats: dict, now: float | None = None) -> StepStats:
        """From a step's :class:`RequestDelta` list and the engine's ``stats()`` after it."""
        now = time.monotonic() if now is None else now
        step = cls(now=now, num_new_tokens=sum(len(d.new_token_ids) for d in deltas),
                   num_running=engine_stats["num_running"], num_waiting=engine_stats["num_waiting"],
                   kv_cache_usage=1.0 - engine_stats["num_free_blocks"] / max(engine_stats["num_total_blocks"], 1),
                   prefix_cache_queries=engine_stats["prefix_cache_queries"],
                   prefix_cache_hits=engine_stats["prefix_cache_hits"],
                   num_preemptions=engine_stats["num_preemptions"],
                   spec_decode=SpecDecodeTotals.of(engine_stats))
        for delta in deltas:
            request = delta.request
            if delta.new_token_ids and request.num_output_tokens == 1:
                step.first_token_latencies.append(now - request.arrival_time)
            if delta.is_finished:
                step.request_latencies.append(now - request.arrival_time)
                if request.first_token_time is not None and request.num_output_tokens > 1:
                    step.time_per_output_token.append(
                        (now - request.first_token_time) / (request.num_output_tokens - 1))
        return step


@dataclass(slots=True, frozen=True)
class SpecDecodeTotals:
    """Speculative decoding's running totals, as the engine counts them (vLLM's ``spec_decode`` names)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]

    @classmethod
    def of(cls, engine_stats: dict) -> SpecDecodeTotals | None:
        if "spec_decode_num_drafts" not in engine_stats:
            return None
        return cls(engine_stats["spec_decode_num_drafts"], engine_stats["spec_decode_num_draft_tokens"],
                   engine_stats["spec_decode_num_accepted_tokens"],
                   tuple(engine_stats["spec_decode_num_accepted_tokens_per_pos"]))


class EngineMetrics:
    """Counters and histograms one engine updates after every step.

    Without prometheus_client only the periodic log line is written; with it, the metrics
    register once per process under ``vllm:``-style names with a ``model_name`` label.
    """

    def __init__(self, model_name: str, log_interval: float = 10.0) -> None:
        self.model_name = model_name
        self.log_interval = log_interval
        self.num_generation_tokens = 0
        self._last_log_time = time.monotonic()
        self._last_log_tokens = 0
        self._prometheus = _prometheus_metrics()
        self._counted: dict[tuple, float] = {}  # this engine's running totals as last added to each counter

    def on_request_added(self, num_prompt_tokens: int) -> None:
        if self._prometheus:
            self._prometheus["prompt_tokens"].labels(self.model_name).inc(num_prompt_tokens)

    def on_step(self, step: StepStats) -> None:
        """Record one step's numbers (the engine builds them with :meth:`StepStats.collect`)."""
        self.num_generation_tokens += step.num_new_tokens
        prom = self._prometheus
        if prom:
            label = self.model_name
            for latency in step.first_token_latencies:
                prom["ttft"].labels(label).observe(latency)
            for latency in step.request_latencies:
                prom["e2e"].labels(label).observe(latency)
            for per_token in step.time_per_output_token:
                prom["tpot"].labels(label).observe(per_token)
            prom["generation_tokens"].labels(label).inc(step.num_new_tokens)
            prom["running"].labels(label).set(step.num_running)
            prom["waiting"].labels(label).set(step.num_waiting)
            prom["kv_usage"].labels(label).set(step.kv_cache_usage)
            self._add_growth(prom["prefix_queries"], (label,), step.prefix_cache_queries)
            self._add_growth(prom["prefix_hits"], (label,), step.prefix_cache_hits)
            self._add_growth(prom["preemptions"], (label,), step.num_preemptions)
            if step.spec_decode is not None:
                self._count_spec_decode(prom, step.spec_decode)
        if step.now - self._last_log_time >= self.log_interval:
            self._log_line(step)

    def _log_line(self, step: StepStats) -> None:
        elapsed = step.now - self._last_log_time
        throughput = (self.num_generation_tokens - self._last_log_tokens) / elapsed
        hit_rate = step.prefix_cache_hits / max(step.prefix_cache_queries, 1)
        logger.info("generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%% used, prefix-cache hit rate %.1f%%",
                    throughput, step.num_running, step.num_waiting, 100 * step.kv_cache_usage, 100 * hit_rate)
        self._last_log_time, self._last_log_tokens = step.now, self.num_generation_tokens

    def _count_spec_decode(self, prom: dict, totals: SpecDecodeTotals) -> None:
        label = self.model_name
        self._add_growth(prom["spec_drafts"], (label,), totals.num_drafts)
        self._add_growth(prom["spec_draft_tokens"], (label,), totals.num_draft_tokens)
        self._add_growth(prom["spec_accepted_tokens"], (label,), totals.num_accepted_tokens)
        for position, num_accepted in enumerate(totals.num_accepted_tokens_per_pos):
            self._add_growth(prom["spec_accepted_per_pos"], (label, str(position)), num_accepted)

    def _add_growth(self, counter, labels: tuple, total: float) -> None:
        """Prometheus counters only go up: add what this engine's running total grew by since the
        last step (engines serving the same model name share the labelled counter)."""
        key = (counter, labels)
        counted = self._counted.get(key, 0)
        if total > counted:
            counter.labels(*labels).inc(total - counted)
        self._counted[key] = total  # a total that restarted (a new pool) counts on from there


_PROMETHEUS = None


def _prometheus_metrics() -> dict | None:
    global _PROMETHEUS
    if _PROMETHEUS is not None:
        return _PROMETHEUS or None
    try:
        from prometheus_client import Counter, Gauge, Histogram
    except ImportError:
        _PROMETHEUS = {}
        return None
    labels = ["model_name"]
    _PROMETHEUS = {
        "running": Gauge("vllm:num_requests_running", "Requests in the running batch.", labels),
        "waiting": Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels),
        "kv_usage": Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", labels),
        "prefix_queries": Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels),
        "prefix_hits": Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels),
        "preemptions": Counter("vllm:num_preemptions", "Preemptions by recompute.", labels),
        "prompt_tokens": Counter("vllm:prompt_tokens", "Prompt tokens admitted.", labels),
        "generation_tokens": Counter("vllm:generation_tokens", "Tokens generated.", labels),
        "ttft": Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                          buckets=_LATENCY_BUCKETS),
        "tpot": Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first.", labels,
                          buckets=_LATENCY_BUCKETS),
        "e2e": Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", labels,
                         buckets=_LATENCY_BUCKETS),
        "spec_drafts": Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels),
        "spec_draft_tokens": Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels),
        "spec_accepted_tokens": Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                        labels),
        "spec_accepted_per_pos": Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft position.", labels + ["position"]),
    }
    return _PROMETHEUS


def start_metrics_server(port: int = 8000, address: str = "127.0.0.1") -> None:
    """Serve ``/metrics`` for Prometheus, on loopback unless told otherwise."""
    try:
        from prometheus_client import start_http_server
    except ImportError as error:
        raise ImportError("start_metrics_server needs prometheus_client: pip install 'hearth-llm[metrics]'") from error
    _prometheus_metrics()
    start_http_server(port, addr=address)
