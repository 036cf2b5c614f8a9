"""Llama 3.1 / 3.2 JSON format: an optional ``<|python_tag|>``, then JSON calls joined by ``; ``.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}
    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}
"""
from __future__ import annotations

import re

from .base import RawCall, Segment, ToolParser, content_tail
from .json_calls import json_call_sequence

PYTHON_TAG = "<|python_tag|>"
# Without the tag, only an output that opens with a call object is a call; other JSON is content.
_CALL_START = re.compile(r'\s*\{\s*"(?:name|type)"\s*:')
_CALL_START_KEYS = ('"name"', '"type"')


class Llama3JsonToolParser(ToolParser):
    """``<|python_tag|>{"name": ..., "parameters": {...}}`` (``"arguments"`` accepted too), several
    joined by ``;``. Text before the tag, or after the last call, is content.

    >>> Llama3JsonToolParser().parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    ParsedOutput(content='', tool_calls=[ToolCall(..., name='a', ...), ToolCall(..., name='b', ...)], ...)
    """

    name = "llama3_json"

    def split(self, text: str, is_final: bool) -> list[Segment]:
        if _CALL_START.match(text):
            return json_call_sequence(text, is_final=is_final, separator=";")
        if not is_final and _may_become_call_start(text):
            return []
        tag = text.find(PYTHON_TAG)
        if tag == -1:
            content = content_tail(text, after_call=False, is_final=is_final, markers=(PYTHON_TAG,))
            return [content] if content else []
        content = text[:tag].rstrip()
        calls = json_call_sequence(text[tag + len(PYTHON_TAG):], is_final=is_final, separator=";")
        if is_final and not calls:
            calls = [RawCall.invalid("", None, f"nothing after {PYTHON_TAG}")]
        return ([content] if content else []) + calls


def _may_become_call_start(text: str) -> bool:
    rest = text.lstrip()
    if not rest:
        return True
    if rest[0] != "{":
        return False
    rest = rest[1:].lstrip()
    return any(key.startswith(rest) or (rest.startswith(key) and not rest[len(key):].strip())
               for key in _CALL_START_KEYS)
