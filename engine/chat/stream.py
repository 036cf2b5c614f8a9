"""``ChatStream``: an engine request's outputs turned into chat deltas and a result.

The turning is written once, in :class:`_ChatAssembler` (plain state, no I/O; one per answer when
``n > 1``); the sync and the async iterators only move engine outputs through it. The output goes
through two splitters in turn: the reasoning parser takes the think block out, and the tool
parser reads calls from what is left, so thinking is never read as a call.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

from ..outputs import StreamOutput, Usage
from ..reasoning import ReasoningParser
from ..streams import RequestStream
from ..tool_parsers import ContentDelta, ParsedOutput, ToolParser
from .result import ChatDelta, ChatResult, ChatUsage, logprob_entry

# A reasoning parser, or what gives it once the model is loaded (the first output has arrived).
ReasoningParserSource = ReasoningParser | Callable[[], ReasoningParser | None] | None


class _ChatAssembler:
    """Accumulates one answer's outputs; splits the think block and tool-call markup from content as it goes."""

    def __init__(self, tool_parser: ToolParser | None, num_top_logprobs: int | None,
                 reasoning_parser: ReasoningParser | None = None):
        self._tool_parser = tool_parser
        self._streamer = tool_parser.streamer() if tool_parser is not None else None
        self._reasoning_parser = reasoning_parser
        self._reasoning_streamer = reasoning_parser.streamer() if reasoning_parser is not None else None
        self._num_top_logprobs = num_top_logprobs  # None: no log-probabilities were asked for
        self._texts: list[str] = []
        self._logprobs: list[dict] = []
        self._num_reasoning_tokens = 0
        self._is_reasoning_done = reasoning_parser is None
        self.result: ChatResult | None = None

    def add(self, output: StreamOutput) -> list[dict] | None:
        """Take an output into the whole answer; returns its log-probability entries."""
        self._texts.append(output.delta_text)
        self._count_reasoning_tokens(output)
        logprobs = self._logprob_entries(output)
        if logprobs is not None:
            self._logprobs.extend(logprobs)
        if _ends_answer(output):
            self.result = self._result(output)
        return logprobs

    def delta(self, output: StreamOutput) -> ChatDelta:
        """Take an output in and say what it added, tool-call deltas included."""
        logprobs = self.add(output)
        is_last = _ends_answer(output)
        reasoning, text = self._split_reasoning(output.delta_text, is_last)
        if self._streamer is None:
            return ChatDelta(output.delta_text, text, logprobs=logprobs, result=self.result, index=output.index,
                             reasoning=reasoning)
        events = self._streamer.feed(text) + (self._streamer.finish() if is_last else [])
        content = "".join(event.text for event in events if isinstance(event, ContentDelta))
        calls = [event for event in events if not isinstance(event, ContentDelta)]
        return ChatDelta(output.delta_text, content, calls, logprobs, self.result, output.index, reasoning)

    def _split_reasoning(self, text: str, is_last: bool) -> tuple[str, str]:
        """The new (reasoning, answer text) in a delta; all answer without a reasoning parser."""
        if self._reasoning_streamer is None:
            return "", text
        reasoning, content = self._reasoning_streamer.feed(text)
        if is_last:
            more_reasoning, more_content = self._reasoning_streamer.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _count_reasoning_tokens(self, output: StreamOutput) -> None:
        """Tokens up to and including the one that closed the think block are reasoning tokens."""
        if self._is_reasoning_done:
            return
        self._num_reasoning_tokens += len(output.delta_token_ids)
        self._is_reasoning_done = self._reasoning_parser.split("".join(self._texts), is_final=False).is_reasoning_done

    def close(self, last: StreamOutput) -> ChatResult:
        """The answer as it stands when its request ended without it (an abort of the whole request)."""
        if self.result is None:
            self.result = self._result(StreamOutput(last.request_id, "", [], finish_reason="abort"))
        return self.result

    def _result(self, last: StreamOutput) -> ChatResult:
        text = "".join(self._texts)
        # The whole text is parsed again rather than rebuilt from the stream: same split, one code path.
        reasoning, answer = "", text
        if self._reasoning_parser is not None:
            split = self._reasoning_parser.parse(text)
            reasoning, answer = split.reasoning, split.content
        parsed = self._tool_parser.parse(answer) if self._tool_parser is not None else ParsedOutput(content=answer)
        return ChatResult(content=parsed.content, text=text, tool_calls=parsed.tool_calls,
                          invalid_tool_calls=parsed.invalid_tool_calls, usage=self.usage(last.usage),
                          finish_reason=last.finish_reason, stop_reason=last.stop_reason,
                          logprobs=self._logprobs if self._num_top_logprobs is not None else None,
                          prompt=last.prompt, reasoning=reasoning)

    def usage(self, usage: Usage | None) -> Usage | ChatUsage | None:
        """The engine's usage, with this answer's reasoning tokens when it may have thought (a
        :class:`ChatUsage`; the engine's :class:`Usage` as is for a model with no reasoning format)."""
        if usage is None or self._reasoning_parser is None:
            return usage
        has_reasoned = self.result.reasoning if self.result is not None else self._has_reasoned()
        return ChatUsage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                         reasoning_tokens=self._num_reasoning_tokens if has_reasoned else 0)

    def _has_reasoned(self) -> bool:
        return self._reasoning_parser is not None and bool(self._reasoning_parser.parse("".join(self._texts)).reasoning)

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

    def __init__(self, stream: RequestStream, tool_parser: ToolParser | None, num_top_logprobs: int | None,
                 reasoning_parser: ReasoningParserSource = None):
        self._stream = stream  # a RequestStream, or a ThinkingStream (two requests read as one)
        self._tool_parser = tool_parser
        self._reasoning_parser = reasoning_parser
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
            if callable(self._reasoning_parser):  # chosen from the model, which has loaded by now
                self._reasoning_parser = self._reasoning_parser()
            self._assemblers[index] = _ChatAssembler(self._tool_parser, self._num_top_logprobs,
                                                     self._reasoning_parser)
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
        assemblers = [self._assemblers[index] for index in sorted(self._assemblers)]
        results = [assembler.close(last) for assembler in assemblers]
        # The request's usage counts every answer; its reasoning tokens too.
        usage = last.usage
        if usage is not None and self._reasoning_parser is not None:
            usage = ChatUsage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                              reasoning_tokens=sum(assembler.usage(usage).reasoning_tokens for assembler in assemblers))
        for result in results:
            result.usage, result.prompt = usage, last.prompt
        self._results = results

    def close(self) -> None:
        """Stop reading; aborts the request unless it already finished."""
        self._stream.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
