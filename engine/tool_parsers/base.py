"""What every tool-call parser shares: the result types, the streaming events, and the streamer.

A format module implements one method, ``ToolParser.split(text, is_final)``: cut the text into
content pieces and calls. ``parse`` is ``split`` of the whole output; the streamer runs ``split`` on
the text received so far and emits only what changed. Because both paths use the same function,
a stream reconstructs exactly what ``parse`` returns for the same text.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import ClassVar, Union


def arguments_json(arguments: dict) -> str:
    """The canonical JSON text of a call's arguments; streamed fragments concatenate to exactly this."""
    return json.dumps(arguments)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call the model made.

    >>> call = ToolCall(id="call_1", name="get_weather", arguments={"city": "Paris"})
    >>> call.arguments_json
    '{"city": "Paris"}'
    """

    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return arguments_json(self.arguments)


@dataclass(frozen=True, slots=True)
class InvalidToolCall:
    """A tool call the model started but wrote malformed; kept so callers can show or repair it.

    ``raw_arguments`` is the model's text for the whole call (everything between its markers).

    >>> InvalidToolCall(id="call_1", name="f", raw_arguments='{"name": "f", "arguments": {oops}}',
    ...                 error="invalid JSON: Expecting property name enclosed in double quotes")
    """

    id: str
    name: str | None
    raw_arguments: str | None
    error: str


@dataclass(slots=True)
class ParsedOutput:
    """Model output split into the text meant for the user and the tool calls.

    >>> get_tool_parser("hermes")().parse('Checking.<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    ParsedOutput(content='Checking.', tool_calls=[ToolCall(id='call_...', name='f', arguments={})], ...)
    """

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """More user-facing text."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """Part of tool call ``index``: the first delta of an index carries ``id`` and ``name`` (later ones
    None); the ``arguments_fragment`` of all its deltas concatenate to ``ToolCall.arguments_json``."""

    index: int
    id: str | None
    name: str | None
    arguments_fragment: str


@dataclass(frozen=True, slots=True)
class InvalidToolCallDelta:
    """Tool call ``index`` turned out malformed: drop whatever was streamed for that index."""

    index: int
    invalid_tool_call: InvalidToolCall


StreamEvent = Union[ContentDelta, ToolCallDelta, InvalidToolCallDelta]


@dataclass(slots=True)
class RawCall:
    """One call as a format module found it in the text (internal to the parsers).

    An open call (still being written) has neither ``arguments`` nor ``error``; its
    ``arguments_prefix`` is the start of the canonical arguments JSON that can no longer change.
    """

    raw: str
    name: str | None = None
    arguments_prefix: str = ""
    arguments: dict | None = None
    error: str | None = None

    @classmethod
    def valid(cls, raw: str, name: str, arguments: dict) -> RawCall:
        return cls(raw, name, arguments_json(arguments), arguments)

    @classmethod
    def invalid(cls, raw: str, name: str | None, error: str) -> RawCall:
        return cls(raw, name, error=error)

    @property
    def is_complete(self) -> bool:
        return self.arguments is not None or self.error is not None


Segment = Union[str, RawCall]


class ToolParser:
    """Splits model output into content and tool calls; each subclass reads one format.

    >>> parser = get_tool_parser("hermes")()
    >>> parser.parse('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>').tool_calls[0].arguments
    {'x': 1}
    >>> stream = parser.streamer()
    >>> events = stream.feed("<tool_call>{") + stream.feed('"name": "f", "arguments": {"x": 1}}') + stream.finish()
    """

    name: ClassVar[str]

    def split(self, text: str, is_final: bool) -> list[Segment]:
        """Cut ``text`` into content strings and calls, in order.

        With ``is_final`` False, ``text`` is a prefix of the output: leave out content that might
        still become a marker (and whitespace that might end up next to a call), and let the last
        call be open. Whatever is returned must stay a prefix of what longer text returns.
        """
        raise NotImplementedError

    def make_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str) -> ParsedOutput:
        """Parse a complete model output. Never raises on malformed output."""
        output = ParsedOutput()
        for segment in self.split(text, is_final=True):
            if isinstance(segment, str):
                output.content += segment
            elif segment.error is None:
                output.tool_calls.append(ToolCall(self.make_call_id(), segment.name, segment.arguments))
            else:
                output.invalid_tool_calls.append(
                    InvalidToolCall(self.make_call_id(), segment.name, segment.raw, segment.error))
        return output

    def streamer(self) -> ToolCallStreamer:
        """A fresh stateful parser for one streamed output."""
        return ToolCallStreamer(self)


@dataclass(slots=True)
class _StreamedCall:
    id: str
    arguments_emitted: str = ""
    is_announced: bool = False
    is_done: bool = False


class ToolCallStreamer:
    """Turns the pieces of a streamed output into content and tool-call events.

    >>> stream = get_tool_parser("hermes")().streamer()
    >>> stream.feed("Let me check. <tool")
    [ContentDelta(text='Let me check.')]
    >>> stream.feed('_call>{"name": "get_weather", "arguments": {"city": "Pa')
    [ToolCallDelta(index=0, id='call_...', name='get_weather', arguments_fragment='{"city": "Pa')]
    >>> stream.feed('ris"}}</tool_call>')
    [ToolCallDelta(index=0, id=None, name=None, arguments_fragment='ris"}')]
    >>> stream.finish()
    []

    Arguments are streamed only as far as they can no longer change, so fragments are never
    retracted; a call that turns out malformed ends with an ``InvalidToolCallDelta``.
    """

    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._text = ""
        self._num_content_chars_emitted = 0
        self._calls: list[_StreamedCall] = []
        self._is_finished = False

    def feed(self, text: str) -> list[StreamEvent]:
        """Add the next piece of output; returns the events it makes certain."""
        if self._is_finished:
            raise RuntimeError("feed() was called after finish(); use a new streamer() per output")
        self._text += text
        return self._events(self._parser.split(self._text, is_final=False))

    def finish(self) -> list[StreamEvent]:
        """The output is complete: flush held-back text and close the last call."""
        if self._is_finished:
            return []
        self._is_finished = True
        return self._events(self._parser.split(self._text, is_final=True))

    def _events(self, segments: list[Segment]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        num_content_chars_seen = 0
        call_index = 0
        for segment in segments:
            if isinstance(segment, str):
                start = max(self._num_content_chars_emitted - num_content_chars_seen, 0)
                num_content_chars_seen += len(segment)
                if start < len(segment):
                    events.append(ContentDelta(segment[start:]))
                    self._num_content_chars_emitted = num_content_chars_seen
            else:
                events.extend(self._call_events(call_index, segment))
                call_index += 1
        return events

    def _call_events(self, index: int, call: RawCall) -> list[StreamEvent]:
        if index == len(self._calls):
            self._calls.append(_StreamedCall(self._parser.make_call_id()))
        state = self._calls[index]
        if state.is_done:
            return []
        if call.error is None and call.name is not None and call.arguments_prefix.startswith(state.arguments_emitted):
            fragment = call.arguments_prefix[len(state.arguments_emitted):]
            state.arguments_emitted = call.arguments_prefix
            state.is_done = call.is_complete
            if not state.is_announced:
                state.is_announced = True
                return [ToolCallDelta(index, state.id, call.name, fragment)]
            return [ToolCallDelta(index, None, None, fragment)] if fragment else []
        if not call.is_complete:
            return []  # nothing about this call is certain yet
        state.is_done = True
        # Only reached for a malformed call, or (defensively) if streamed arguments had diverged.
        error = call.error or "streamed arguments diverged from the final parse"
        return [InvalidToolCallDelta(index, InvalidToolCall(state.id, call.name, call.raw, error))]


def strip_around_calls(text: str, *, after_call: bool, before_call: bool) -> str:
    """Whitespace that only separates content from a call is not content."""
    if after_call:
        text = text.lstrip()
    return text.rstrip() if before_call else text


def content_tail(text: str, *, after_call: bool, is_final: bool, markers: tuple[str, ...] = ()) -> str:
    """The content at the end of the text so far; until the output is final, hold back a suffix that
    may be the start of a marker, and trailing whitespace (a call may follow it)."""
    if is_final:
        return strip_around_calls(text, after_call=after_call, before_call=False)
    held_back = max((_partial_marker_len(text, marker) for marker in markers), default=0)
    return strip_around_calls(text[:len(text) - held_back], after_call=after_call, before_call=True)


def _partial_marker_len(text: str, marker: str) -> int:
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
