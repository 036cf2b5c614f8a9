"""``hearth-llm bench serving``'s client and measures, driven against an in-process server on a tiny
model (the benchmark itself runs servers in their own processes; see benchmarks/serving.py)."""
from __future__ import annotations

import math

from hearth_llm.benchmarks.serving import (RequestRecord, http_sender, in_process_sender, measure, summarize,
                                           workload)
from hearth_llm.engine import get_engine
from hearth_llm.server import start_server

ENGINE = {"dtype": "float32", "show_progress": False}
TINY_IDS = (4, 319)  # the tiny vocabulary's ordinary tokens


def test_the_bench_client_measures_every_request_over_http_and_in_process(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    requests = workload(6, (3, 12), (2, 5), token_ids=TINY_IDS)
    with start_server(model, embedding_model=None, served_model_name="bench", **ENGINE) as running:
        over_http = measure(http_sender(running.host, running.port), requests, [math.inf, 50.0], 0, TINY_IDS)
        in_process = measure(in_process_sender(get_engine(model, **ENGINE)), requests, [math.inf], 0, TINY_IDS)
    for result in (over_http["inf"], over_http["50"], in_process["inf"]):
        assert (result["num_completed"], result["num_failed"]) == (6, 0), result["first_errors"]
        assert result["output_tok_per_s"] > 0 and 0 < result["ttft_ms_p50"] <= result["ttft_ms_p99"]
        assert result["itl_ms_p50"] <= result["itl_ms_p99"] and result["tpot_ms_p50"] > 0


def test_a_request_short_of_its_max_tokens_or_failed_counts_as_failed():
    whole = RequestRecord(sent=0.0, token_times=[0.1, 0.2, 0.3], ended=0.3, num_output_tokens=3)
    short = RequestRecord(sent=0.0, token_times=[0.1], ended=0.2, num_output_tokens=1)
    failed = RequestRecord(sent=0.0, ended=0.1, error="HTTP 500: boom")
    summary = summarize([whole, short, failed], [3, 3, 3])
    assert (summary["num_completed"], summary["num_failed"]) == (1, 2)
    assert summary["first_errors"] == ["1 tokens, expected 3", "HTTP 500: boom"]
    assert summary["ttft_ms_p50"] == 100.0 and summary["tpot_ms_p50"] == 100.0
    assert summary["output_tok_per_s"] == 10.0  # 3 tokens over the run's 0.3 s
