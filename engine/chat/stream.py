"""``ChatStream``: an engine request's outputs turned into chat deltas and a result.

The turning is written once, in :class:`_ChatAssembler` (plain state, no I/O; one per answer when
``n > 1``); the sync and the async iterators only move engine outputs through it.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from ..outputs import StreamOutput
from ..streams import RequestStream
from ..tool_parsers import ContentDelta, ParsedOutput, ToolParser
from .result import ChatDelta, ChatResult, logprob_entry


class _ChatAssembler:
    """Accumulates one answer's outputs; with a tool parser, splits markup from content as it goes."""

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
        if _ends_answer(output):
            self.result = self._result(output)
        return logprobs

    def delta(self, output: StreamOutput) -> ChatDelta:
        """Take an output in and say what it added, tool-call deltas included."""
        logprobs = self.add(output)
        if self._streamer is None:
            return ChatDelta(output.delta_text, output.delta_text, logprobs=logprobs, result=self.result,
                             index=output.index)
        events = self._streamer.feed(output.delta_text) + (self._streamer.finish() if _ends_answer(output) else [])
        content = "".join(event.text for event in events if isinstance(event, ContentDelta))
        calls = [event for event in events if not isinstance(event, ContentDelta)]
        return ChatDelta(output.delta_text, content, calls, logprobs, self.result, output.index)

    def close(self, last: StreamOutput) -> ChatResult:
        """The answer as it stands when its request ended without it (an abort of the whole request)."""
        if self.result is None:
            self.result = self._result(StreamOutput(last.request_id, "", [], finish_reason="abort"))
        return self.result

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


def _ends_answer(output: StreamOutput) -> bool:
    """An answer's last output has its finish reason; the request's last also ends every answer."""
    return output.finish_reason is not None or output.finished


class ChatStream:
    """A chat answer as it is generated: iterate it (``for`` or ``async for``) for ``ChatDelta``s,
    the last of which carries the ``ChatResult``; or ``collect()`` / ``await acollect()`` it.
    With ``SamplingOptions(n=...)``, the ``n`` answers' deltas interleave and ``results`` lists them.

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
        self._tool_parser = tool_parser
        self._num_top_logprobs = num_top_logprobs
        self._assemblers: dict[int, _ChatAssembler] = {}  # one per answer (n of them), by index
        self._results: list[ChatResult] | None = None

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def result(self) -> ChatResult | None:
        """The whole answer (the first, with ``n > 1``), once the last delta was read."""
        return self._results[0] if self._results else None

    @property
    def results(self) -> list[ChatResult] | None:
        """Every answer by index (``n`` of them), once the last delta was read."""
        return self._results

    def __iter__(self) -> Iterator[ChatDelta]:
        try:
            for output in self._stream:
                yield self._delta(output)
        finally:  # a consumer that stops early aborts the request now, not when the stream is collected
            self.close()

    async def __aiter__(self) -> AsyncIterator[ChatDelta]:
        try:
            async for output in self._stream:
                yield self._delta(output)
        finally:
            self.close()

    def collect(self) -> ChatResult:
        """Read the stream to its end; the whole answer (tool calls parsed once, from the whole text)."""
        for output in self._stream:
            self._add(output)
        return self.result

    async def acollect(self) -> ChatResult:
        async for output in self._stream:
            self._add(output)
        return self.result

    def _assembler(self, index: int) -> _ChatAssembler:
        if index not in self._assemblers:
            self._assemblers[index] = _ChatAssembler(self._tool_parser, self._num_top_logprobs)
        return self._assemblers[index]

    def _delta(self, output: StreamOutput) -> ChatDelta:
        delta = self._assembler(output.index).delta(output)
        if output.finished:
            self._finish(output)
        return delta

    def _add(self, output: StreamOutput) -> None:
        self._assembler(output.index).add(output)
        if output.finished:
            self._finish(output)

    def _finish(self, last: StreamOutput) -> None:
        """The request's last output: every answer gets the request's usage and rendered prompt."""
        results = [self._assemblers[index].close(last) for index in sorted(self._assemblers)]
        for result in results:
            result.usage, result.prompt = last.usage, last.prompt
        self._results = results

    def close(self) -> None:
        """Stop reading; aborts the request unless it already finished."""
        self._stream.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
