"""A marker, then a JSON list of calls: Granite 3.x and Phi-4-mini.

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]                  (Granite 3.x)
    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]                      (Phi-4-mini)

Text before the marker is content; a closing tag (Phi-4-mini's template shows ``<|/tool_call|>``)
may end the list. ``"parameters"`` is accepted for ``"arguments"``.
"""
from __future__ import annotations

from typing import ClassVar

from .base import RawCall, Segment, ToolParser, content_tail
from .json_calls import find_outside_json_strings, json_call_sequence


class JsonListToolParser(ToolParser):
    """``MARKER[{"name": ..., "arguments": {...}}, ...]``, one list per output.

    >>> GraniteToolParser().parse('<|tool_call|>[{"name": "f", "arguments": {"x": 1}}]').tool_calls[0].arguments
    {'x': 1}
    """

    marker: ClassVar[str]
    closing_tags: ClassVar[tuple[str, ...]] = ()

    def split(self, text: str, is_final: bool) -> list[Segment]:
        start = text.find(self.marker)
        if start == -1:
            content = content_tail(text, after_call=False, is_final=is_final, markers=(self.marker,))
            return [content] if content else []
        segments: list[Segment] = [text[:start].rstrip()]
        body = text[start + len(self.marker):]
        end = find_outside_json_strings(body, 0, self.closing_tags) if self.closing_tags else -1
        is_body_final = is_final or end != -1
        after = ""
        if end != -1:
            tag = next(tag for tag in self.closing_tags if body.startswith(tag, end))
            body, after = body[:end], body[end + len(tag):]
        segments += self._calls(body, is_body_final)
        if end != -1:
            segments.append(content_tail(after, after_call=True, is_final=is_final))
        return [segment for segment in segments if segment != ""]

    def _calls(self, body: str, is_final: bool) -> list[Segment]:
        stripped = body.lstrip()
        if stripped.startswith("["):
            calls = json_call_sequence(stripped[1:], is_final=is_final, separator=",", closer="]")
        elif stripped.startswith("{"):  # a single call, not in a list
            calls = json_call_sequence(stripped, is_final=is_final, separator=",")
        else:
            calls = []
        if is_final and not any(isinstance(call, RawCall) for call in calls):
            calls.insert(0, RawCall.invalid(body.strip(), None, f"expected a JSON list of calls after {self.marker}"))
        elif not is_final and calls and isinstance(calls[-1], str):  # text after the list may start a closing tag
            calls[-1] = content_tail(calls[-1], after_call=True, is_final=False, markers=self.closing_tags)
        return calls


class GraniteToolParser(JsonListToolParser):
    name = "granite"
    marker = "<|tool_call|>"
    closing_tags = ("<|/tool_call|>",)


class Phi4MiniToolParser(JsonListToolParser):
    name = "phi4_mini"
    marker = "functools"
