"""OpenTelemetry: one SERVER span per HTTP request, recorded with opentelemetry-sdk's in-memory
exporter, carrying the request id, status, key, model and token counts, and joining a client's
trace from its ``traceparent`` header."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from hearth_llm.server import start_server

ENGINE = {"dtype": "float32", "show_progress": False}
KEY = "sk-otel"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


@pytest.fixture(scope="module")
def traced(tiny_model_dirs):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with start_server(str(tiny_model_dirs["llama"]), api_key=KEY, embedding_model=None, tracer_provider=provider,
                      **ENGINE) as running:
        yield running, exporter


def span_of(exporter: InMemorySpanExporter, request_id: str):
    """The span of the request, once the server has ended it (after its last byte went out)."""
    deadline = time.monotonic() + 5
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.attributes.get("hearth.request_id") == request_id]
        if spans or time.monotonic() > deadline:
            assert len(spans) == 1, spans
            return spans[0]
        time.sleep(0.02)


def post(running, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{running.url}/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}", **headers})


def test_a_completion_is_one_server_span_with_its_request_id_status_model_and_tokens(traced):
    running, exporter = traced
    response = post(running, {"model": "default", "prompt": "w5 w6 w7", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200
    span = span_of(exporter, response.headers["x-request-id"])
    assert span.name == "POST /v1/completions" and span.kind == SpanKind.SERVER
    usage = response.json()["usage"]
    assert dict(span.attributes) == {
        "http.request.method": "POST", "url.path": "/v1/completions", "hearth.request_id": response.headers[
            "x-request-id"], "http.response.status_code": 200, "gen_ai.request.model": "default",
        "gen_ai.usage.input_tokens": usage["prompt_tokens"], "gen_ai.usage.output_tokens": 3,
        "hearth.tenant": "key-0", "hearth.engine_request_id": response.json()["id"]}
    assert span.status.status_code != StatusCode.ERROR


def test_a_streamed_answers_span_lasts_to_its_end_and_carries_its_usage(traced):
    running, exporter = traced
    body = {"model": "default", "prompt": "w9 w10", "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started_ns = time.time_ns()
    with httpx.stream("POST", f"{running.url}/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
        request_id = response.headers["x-request-id"]
    done_ns = time.time_ns()
    usage = json.loads(lines[-2][5:])["usage"]
    span = span_of(exporter, request_id)
    assert started_ns <= span.start_time and span.end_time >= span.start_time
    assert span.end_time > done_ns - 1_000_000_000  # it ended with the stream, not at its first event
    assert span.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5
    assert span.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]


def test_refused_requests_have_spans_with_their_status_and_a_client_trace_is_joined(traced):
    running, exporter = traced
    traceparent = f"00-{TRACE_ID}-b7ad6b7169203331-01"
    unknown = post(running, {"model": "gpt-4o", "prompt": "w5"}, traceparent=traceparent)
    assert unknown.status_code == 404
    span = span_of(exporter, unknown.headers["x-request-id"])
    assert span.attributes["http.response.status_code"] == 404
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == "b7ad6b7169203331"
    no_key = httpx.post(f"{running.url}/completions", json={"model": "default", "prompt": "w5"})
    assert no_key.status_code == 401
    span = span_of(exporter, no_key.headers["x-request-id"])
    assert span.attributes["http.response.status_code"] == 401 and "hearth.tenant" not in span.attributes
