"""Hermes format, used by Qwen2.5/Qwen3 and many ChatML models: JSON calls between tags.

    I'll check both cities.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Rome"}}
    </tool_call>
"""
from __future__ import annotations

from .base import Segment, ToolParser, content_tail, strip_around_calls
from .json_calls import complete_json_call, find_outside_json_strings, open_json_call

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number; text outside the tags
    is content. A call missing its closing tag (a stop string ate it, or the next call began) still counts.

    >>> HermesToolParser().parse('Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    ParsedOutput(content='Sure.', tool_calls=[ToolCall(id='call_...', name='f', arguments={'x': 1})], ...)
    """

    name = "hermes"

    def split(self, text: str, is_final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            segments.append(strip_around_calls(text[pos:start], after_call=pos > 0, before_call=True))
            body_start = start + len(START)
            # A tag inside a JSON string is text; a new <tool_call> also ends a call left unclosed.
            end = find_outside_json_strings(text, body_start, (END, START))
            if end == -1:
                body = text[body_start:]
                segments.append(complete_json_call(body) if is_final else open_json_call(body))
                return [segment for segment in segments if segment != ""]
            segments.append(complete_json_call(text[body_start:end]))
            pos = end + len(END) if text.startswith(END, end) else end
        segments.append(content_tail(text[pos:], after_call=pos > 0, is_final=is_final, markers=(START,)))
        return [segment for segment in segments if segment != ""]
