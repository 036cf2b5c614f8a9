"""An OpenAI-compatible HTTP server over the in-process engine: any OpenAI client, LangChain's
``ChatOpenAI(base_url=...)``, LlamaIndex's ``OpenAILike`` or curl talks to the same engine (and KV
cache) that this process's ``LLM`` and ``ChatHearth`` use.

    pip install "hearth-llm[server]"
    hearth-llm serve default --port 8000 --api-key sk-local

>>> from hearth_llm.server import start_server
>>> server = start_server("default")                   # on a background thread, 127.0.0.1, a free port
>>> client = openai.OpenAI(base_url=server.url, api_key="unused")
>>> client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi!"}])
>>> server.stop()

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /metrics``.

Why FastAPI on uvicorn: the request bodies are pydantic models, so types and unknown fields are
checked before any endpoint code runs and ``/docs`` lists every accepted field; FastAPI is a thin
layer on Starlette, whose responses carry SSE without another dependency (``sse`` sends the events
itself); uvicorn is the ASGI server vLLM's and most OpenAI-compatible servers run on, drains requests
in flight on SIGTERM, and runs on a background thread for in-process use. The endpoints are thin mappers:
chat goes through the chat service (``hearth_llm.engine.chat``) exactly as ``ChatHearth`` does;
completions and embeddings go to the public engine APIs.

Limits: per-key quotas (``--api-key KEY:RPM:TPM`` or ``APIKey``: past them 429 with OpenAI's
body and ``Retry-After``), a queue bound (``--max-queued-requests``: 503), per-key waiting rates
(``rate_limit``), body/``n``/``max_tokens`` caps, timeouts (504). Each request is one JSON log line
and one OpenTelemetry span (``pip install 'hearth-llm[otel]'`` and configure a tracer provider).

Where the engine loop runs: ``hearth-llm serve`` on CUDA gives it its own process
(``engine_core="process"``, as vLLM's server does), so the HTTP event loop and the engine never wait
for each other's interpreter lock (H200, Qwen3-0.6B shape: 1.09x the thread core's output tokens/s at
64 req/s, 1.21x all at once); on the CPU, and for ``start_server`` / ``serve()`` in a process that also
runs ``ChatHearth`` on the same engine, it stays a thread (``--engine-core`` / ``engine_core=`` choose).

The layout: ``app`` (routes, error handlers), ``middleware`` (request id, API key, body cap,
disconnect → abort, JSON log, span), ``protocol`` (request bodies), ``chat`` / ``completions`` /
``embeddings`` / ``tokenize`` (one endpoint family each), ``sse``, ``errors``, ``ids``, ``quotas``,
``settings``, ``state``, ``launch`` (uvicorn: ``serve``, ``start_server``), ``cli`` (``hearth-llm serve``).
"""
from __future__ import annotations

import importlib

__all__ = ["create_app", "serve", "start_server", "RunningServer", "ServerSettings"]


def __getattr__(name: str):
    # Lazy, so that `hearth-llm --help` (which imports .cli) works without the [server] extra.
    if name not in __all__:
        raise AttributeError(f"module 'hearth_llm.server' has no attribute {name!r}")
    module = "settings" if name == "ServerSettings" else "app" if name == "create_app" else "launch"
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ImportError as error:
        raise ImportError("hearth_llm.server needs FastAPI and uvicorn: pip install 'hearth-llm[server]'") from error
