"""Server-sent events as OpenAI streams them: ``data: {json}`` per chunk, ``data: [DONE]`` last.

:class:`EventStreamResponse` closes the engine streams it was built over however it ends (all sent,
the client gone, an error), so no request outlives its response.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    """One SSE event carrying ``payload`` as compact JSON.

    >>> event({"a": 1})
    'data: {"a":1}\\n\\n'
    """
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response over ``events``; ``on_close`` runs when it ends, however it ends.

    >>> EventStreamResponse(chat_events(...), on_close=stream.close)
    """

    def __init__(self, events: AsyncIterator[str], *, on_close: Callable[[], None],
                 headers: dict[str, str] | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # also when the events never started (the client left before the first one)
            self._on_close()
