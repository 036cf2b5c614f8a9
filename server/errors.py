"""Errors in OpenAI's body shape, ``{"error": {"message", "type", "param", "code"}}``, and which
status each failure of a request maps to.

>>> APIError(400, "temperature must be in [0.0, 2.0], got 3", param="temperature").body()
{'error': {'message': 'temperature must be in [0.0, 2.0], got 3', 'type': 'invalid_request_error', 'param': 'temperature', 'code': None}}
"""
from __future__ import annotations

import re

from hearth_llm.embeddings import EmbeddingEngineDeadError, EmbeddingFailedError
from hearth_llm.engine.errors import (EngineDeadError, EngineOverloadedError, RequestFailedError,
                                      RequestTimeoutError)

# Seconds a client is told to wait before it retries an overloaded server.
RETRY_AFTER_S = 1

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
          504: "timeout_error"}
# "temperature must be ...", "messages[0]['content']: ...", "stream_options.include_usage ...": the leading name.
_LEADING_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


class APIError(Exception):
    """A request that fails with ``status``; ``param`` names the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.error_type = error_type  # None: the status's (OpenAI's quota errors say "requests"/"tokens")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type or _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def invalid_parameter(error: Exception, known_fields: frozenset[str] = frozenset()) -> APIError:
    """A 400 for a ``ValueError``/``TypeError`` the engine raised; its message starts with the
    parameter's name (the engine's rule), which becomes ``param`` when it is a request field."""
    message = str(error)
    match = _LEADING_NAME.match(message)
    param = match.group(1) if match and match.group(1) in known_fields else None
    return APIError(400, message, param=param)


def engine_failure(error: BaseException) -> APIError | None:
    """The status an engine error means, or None for an error that is not the engine's."""
    if isinstance(error, EngineOverloadedError):
        return APIError(503, str(error), code="engine_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, RequestTimeoutError):
        return APIError(504, str(error), code="request_timeout")
    if isinstance(error, (EngineDeadError, EmbeddingEngineDeadError)):
        return APIError(503, f"the engine is not running: {error}", code="engine_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, (RequestFailedError, EmbeddingFailedError)):
        return APIError(500, str(error), code="request_failed")
    return None
