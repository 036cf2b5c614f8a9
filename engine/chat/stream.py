"""``ChatStream``: an engine request's outputs turned into chat deltas and a result.

The turning is written once, in :class:`_ChatAssembler` (plain state, no I/O); the sync and the
async iterators only move engine outputs through it.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from ..outputs import StreamOutput
from ..streams import RequestStream
from ..tool_parsers import ContentDelta, ParsedOutput, ToolParser
from .result import ChatDelta, ChatResult, logprob_entry


class _ChatAssembler:
    """Accumulates one request's outputs; with a tool parser, splits markup from content as it goes."""

    def __init__(self, tool_parser: ToolParser | None, num_top_logprobs: int | None):
        self._tool_parser = tool_parser
        self._streamer = tool_parser.streamer() if tool_parser is not None else None
        self._num_top_logprobs = num_top_logprobs  # None: no log-probabilities were asked for
        self._texts: list[str] = []
        self._logprobs: list[dict] = []
        self.result: ChatResult | None = None

    def add(self, output: StreamOutput) -> list[dict] | None:
        """Take an output into the whole answer; returns its log-probability entries."""
        self._texts.append(output.delta_text)
        logprobs = self._logprob_entries(output)
        if logprobs is not None:
            self._logprobs.extend(logprobs)
        if output.finished:
            self.result = self._result(output)
        return logprobs

    def delta(self, output: StreamOutput) -> ChatDelta:
        """Take an output in and say what it added, tool-call deltas included."""
        logprobs = self.add(output)
        if self._streamer is None:
            return ChatDelta(output.delta_text, output.delta_text, logprobs=logprobs, result=self.result)
        events = self._streamer.feed(output.delta_text) + (self._streamer.finish() if output.finished else [])
        content = "".join(event.text for event in events if isinstance(event, ContentDelta))
        calls = [event for event in events if not isinstance(event, ContentDelta)]
        return ChatDelta(output.delta_text, content, calls, logprobs, self.result)

    def _result(self, last: StreamOutput) -> ChatResult:
        text = "".join(self._texts)
        # The whole text is parsed again rather than rebuilt from the stream: same calls, one code path.
        parsed = self._tool_parser.parse(text) if self._tool_parser is not None else ParsedOutput(content=text)
        return ChatResult(content=parsed.content, text=text, tool_calls=parsed.tool_calls,
                          invalid_tool_calls=parsed.invalid_tool_calls, usage=last.usage,
                          finish_reason=last.finish_reason, stop_reason=last.stop_reason,
                          logprobs=self._logprobs if self._num_top_logprobs is not None else None,
                          prompt=last.prompt)

    def _logprob_entries(self, output: StreamOutput) -> list[dict] | None:
        if self._num_top_logprobs is None:
            return None
        return [logprob_entry(token_id, entries, self._num_top_logprobs)
                for token_id, entries in zip(output.delta_token_ids, output.logprobs or [])]


class ChatStream:
    """A chat answer as it is generated: iterate it (``for`` or ``async for``) for ``ChatDelta``s,
    the last of which carries the ``ChatResult``; or ``collect()`` / ``await acollect()`` it.

    >>> with service.stream(request) as stream:
    ...     for delta in stream:
    ...         print(delta.content, end="")
    >>> stream.result.tool_calls

    Leaving early or ``close()`` aborts the request and frees its KV blocks before the next step.
    Errors arrive as the engine's exceptions (``ValueError`` for a prompt the template rejects,
    ``TimeoutError``, :class:`RequestFailedError`, :class:`EngineDeadError`).
    """

    def __init__(self, stream: RequestStream, tool_parser: ToolParser | None, num_top_logprobs: int | None):
        self._stream = stream
        self._assembler = _ChatAssembler(tool_parser, num_top_logprobs)

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def result(self) -> ChatResult | None:
        """The whole answer, once the last delta was read."""
        return self._assembler.result

    def __iter__(self) -> Iterator[ChatDelta]:
        try:
            for output in self._stream:
                yield self._assembler.delta(output)
        finally:  # a consumer that stops early aborts the request now, not when the stream is collected
            self.close()

    async def __aiter__(self) -> AsyncIterator[ChatDelta]:
        try:
            async for output in self._stream:
                yield self._assembler.delta(output)
        finally:
            self.close()

    def collect(self) -> ChatResult:
        """Read the stream to its end; the whole answer (tool calls parsed once, from the whole text)."""
        for output in self._stream:
            self._assembler.add(output)
        return self._assembler.result

    async def acollect(self) -> ChatResult:
        async for output in self._stream:
            self._assembler.add(output)
        return self._assembler.result

    def close(self) -> None:
        """Stop reading; aborts the request unless it already finished."""
        self._stream.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
