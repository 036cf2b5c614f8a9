"""Server-sent events as OpenAI streams them: ``data: {json}`` per chunk, ``data: [DONE]`` last.

:class:`EventStreamResponse` closes the engine streams it was built over however it ends (all sent,
the client gone, an error), so no request outlives its response.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import Response

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    """One SSE event carrying ``payload`` as compact JSON.

    >>> event({"a": 1})
    'data: {"a":1}\\n\\n'
    """
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class EventStreamResponse(Response):
    """A ``text/event-stream`` response over ``events``; ``on_close`` runs when it ends, however it ends.

    >>> EventStreamResponse(chat_events(...), on_close=stream.close)

    Leaner than Starlette's ``StreamingResponse``, which under uvicorn (ASGI spec 2.3) runs each
    stream in a task group with a second task that waits for the client to leave: the server
    middleware watches for that already, and cancels the response when it happens. Each event is
    one ``send``; the event that ends with ``[DONE]`` also ends the body (one write, not two).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], *, on_close: Callable[[], None],
                 headers: dict[str, str] | None = None):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for text in self.events:
                is_last = text.endswith(DONE)
                await send({"type": "http.response.body", "body": text.encode(), "more_body": not is_last})
                if is_last:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:  # also when the events never started (the client left before the first one)
            try:
                await self.events.aclose()
            finally:
                self._on_close()
