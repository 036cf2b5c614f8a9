"""What every HTTP request goes through before and after its endpoint, as one ASGI wrapper:

1. a request id, the client's ``X-Request-Id`` when it is a sane one, echoed in the response;
2. the API key, compared in constant time (401 before the body is read);
3. the body, read whole up to ``max_body_bytes`` (413 past it, from ``Content-Length`` or as it arrives);
4. the endpoint, cancelled the moment the client disconnects: the engine streams it reads close,
   which aborts their requests and frees their KV blocks before the engine's next step;
5. one JSON log line, and an OpenTelemetry span (a no-op until the process configures a tracer
   provider: ``pip install 'hearth-llm[otel]'``, then ``opentelemetry-instrument hearth-llm serve ...``
   or ``trace.set_tracer_provider(...)`` in-process). The span covers the whole exchange, a stream
   to its last event; its attributes are in :data:`SPAN_ATTRIBUTES`.

The endpoint sees the body replayed from memory, so it never reads the socket itself and the
disconnect watcher is the only reader.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import re
import time

import anyio

from .errors import APIError
from .ids import random_hex

logger = logging.getLogger("hearth_llm.server")

# Paths anyone may read: liveness and metrics for probes and scrapers, and the API's own schema.
OPEN_PATHS = frozenset({"/health", "/metrics", "/docs", "/openapi.json"})
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

try:  # fastapi depends on opentelemetry-api; spans are no-ops until an SDK is configured
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - an install without it
    _trace = None


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def find_key(authorization: str | None, key_digests: tuple[bytes, ...]) -> int | None:
    """The index of the key that ``Authorization: Bearer KEY`` presents, or None.

    Digests of equal length are compared with ``hmac.compare_digest``, every key every time, so
    neither the time nor the path taken says how much of a guess was right.
    """
    scheme, _, presented = (authorization or "").partition(" ")
    digest = key_digest(presented.strip() if scheme.lower() == "bearer" else "")
    found = None
    for index, expected in enumerate(key_digests):
        if hmac.compare_digest(digest, expected) and found is None:
            found = index
    return found


class ServerMiddleware:
    """The ASGI wrapper of the module docstring around the FastAPI app."""

    def __init__(self, app, *, api_keys: tuple[str, ...], max_body_bytes: int, tracer_provider=None):
        self.app = app
        self.key_digests = tuple(key_digest(key) for key in api_keys)
        self.max_body_bytes = max_body_bytes
        # the global provider's tracer is a proxy: a provider the process sets later is used too
        self.tracer = None if _trace is None else _trace.get_tracer("hearth_llm.server",
                                                                    tracer_provider=tracer_provider)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        request_id = _request_id(headers.get("x-request-id"))
        log = {"request_id": request_id, "method": scope["method"], "path": scope["path"]}
        scope.setdefault("state", {}).update(request_id=request_id, log=log)
        exchange = _Exchange(send, request_id, scope["state"])
        started = time.monotonic()
        with _span(self.tracer, scope, headers, request_id) as span:
            try:
                await self._handle(scope, receive, exchange, headers)
            finally:
                log.update(status=exchange.status, duration_ms=round(1000 * (time.monotonic() - started), 1))
                if exchange.is_disconnected:
                    log["client_disconnected"] = True
                if span is not None:
                    _end_span(span, log)
                logger.info(json.dumps(log, default=str))

    async def _handle(self, scope, receive, exchange: _Exchange, headers: dict[str, str]) -> None:
        try:
            self._authorize(scope, headers)
            body = await self._read_body(receive, headers)
        except APIError as error:
            await exchange.send_error(error)
            return
        except _ClientGone:
            exchange.is_disconnected = True
            return
        await self._run_until_disconnect(scope, body, receive, exchange)

    def _authorize(self, scope, headers: dict[str, str]) -> None:
        index = find_key(headers.get("authorization"), self.key_digests) if self.key_digests else None
        if self.key_digests and index is None and scope["path"] not in OPEN_PATHS:
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        # the rate limiter's tenant and the log's: which key (by position), never the key itself
        tenant = f"key-{index}" if index is not None else "anonymous"
        scope["state"]["tenant"] = scope["state"]["log"]["tenant"] = tenant

    async def _read_body(self, receive, headers: dict[str, str]) -> bytes:
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} bytes",
                        code="request_too_large")

    async def _run_until_disconnect(self, scope, body: bytes, receive, exchange: _Exchange) -> None:
        is_body_read = False
        disconnected = anyio.Event()

        async def replay():
            nonlocal is_body_read
            if not is_body_read:
                is_body_read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async with anyio.create_task_group() as group:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not exchange.is_complete:  # a disconnect after the last byte is just the connection closing
                    exchange.is_disconnected = True
                    disconnected.set()
                    group.cancel_scope.cancel()  # the endpoint too: its engine streams close and abort

            group.start_soon(watch)
            await self.app(scope, replay, exchange.send)
            group.cancel_scope.cancel()


class _ClientGone(Exception):
    pass


class _Exchange:
    """The response side of one request: adds the request id (and the endpoint's
    ``request.state.response_headers``: the key's quota), remembers the status and the end."""

    def __init__(self, send, request_id: str, request_state: dict):
        self._send = send
        self.request_id = request_id
        self._request_state = request_state
        self.status: int | None = None
        self.is_complete = False
        self.is_disconnected = False

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            extra = self._request_state.get("response_headers") or {}
            headers = [*message.get("headers", []), (b"x-request-id", self.request_id.encode()),
                       *((name.lower().encode(), value.encode()) for name, value in extra.items())]
            message = {**message, "headers": headers}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.is_complete = True
        await self._send(message)

    async def send_error(self, error: APIError) -> None:
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   *((name.lower().encode(), value.encode()) for name, value in error.headers.items())]
        await self.send({"type": "http.response.start", "status": error.status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})


def _request_id(client_id: str | None) -> str:
    if client_id is not None and _CLIENT_REQUEST_ID.match(client_id):
        return client_id
    return random_hex()


# The log's fields a request's span carries (OpenTelemetry's HTTP and GenAI names where they have one).
SPAN_ATTRIBUTES = {"status": "http.response.status_code", "model": "gen_ai.request.model",
                   "prompt_tokens": "gen_ai.usage.input_tokens", "completion_tokens": "gen_ai.usage.output_tokens",
                   "tenant": "hearth.tenant", "engine_request_id": "hearth.engine_request_id",
                   "client_disconnected": "hearth.client_disconnected"}


def _end_span(span, log: dict) -> None:
    for field, attribute in SPAN_ATTRIBUTES.items():
        if isinstance(log.get(field), (str, int, bool)):
            span.set_attribute(attribute, log[field])
    if isinstance(log.get("status"), int) and log["status"] >= 500:
        span.set_status(_trace.Status(_trace.StatusCode.ERROR, f"HTTP {log['status']}"))


@contextlib.contextmanager
def _span(tracer, scope, headers: dict[str, str], request_id: str):
    if tracer is None:
        yield None
        return
    # a client's W3C traceparent header makes this span a child of the client's
    attributes = {"http.request.method": scope["method"], "url.path": scope["path"], "hearth.request_id": request_id}
    with tracer.start_as_current_span(f"{scope['method']} {scope['path']}", kind=_trace.SpanKind.SERVER,
                                       context=_propagate.extract(headers), attributes=attributes) as span:
        yield span
