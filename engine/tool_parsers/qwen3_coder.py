"""Qwen3-Coder's XML format: a function and its parameters as tags, values as plain text.

    I'll look it up.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value that reads as JSON other than a string (``3``, ``true``, ``[1, 2]``, ``{"a": 1}``, ``null``)
becomes that value, any other text a string. The parser does not see the tools' schemas, so a
string parameter whose value looks like a number comes back as a number (vLLM converts by schema).
"""
from __future__ import annotations

import json
import re

from .base import RawCall, Segment, ToolParser, content_tail, strip_around_calls

TOOL_CALL, END_TOOL_CALL, FUNCTION = "<tool_call>", "</tool_call>", "<function="
_FUNCTION = re.compile(r"\s*<function=([^>]*)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_END = re.compile(r"\s*</function>(?:\s*</tool_call>)?")
_START = re.compile(re.escape(TOOL_CALL) + "|" + re.escape(FUNCTION))


class Qwen3CoderToolParser(ToolParser):
    """``<tool_call><function=name><parameter=key>value</parameter>…</function></tool_call>``, any
    number of them (``<tool_call>`` may be left out); text outside is content. A call whose
    ``</function>`` never came (cut by ``max_tokens``) is invalid.

    >>> Qwen3CoderToolParser().parse("<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>")
    ParsedOutput(content='', tool_calls=[ToolCall(id='call_...', name='f', arguments={'x': 1})], ...)
    """

    name = "qwen3_coder"

    def split(self, text: str, is_final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while (match := _START.search(text, pos)) is not None:
            segments.append(strip_around_calls(text[pos:match.start()], after_call=pos > 0, before_call=True))
            call, end = _read_call(text, match.start(), is_final)
            segments.append(call)
            if end is None:
                return [segment for segment in segments if segment != ""]
            pos = end
        segments.append(content_tail(text[pos:], after_call=pos > 0, is_final=is_final,
                                     markers=(TOOL_CALL, FUNCTION, END_TOOL_CALL)))
        return [segment for segment in segments if segment != ""]


def _read_call(text: str, start: int, is_final: bool) -> tuple[RawCall, int | None]:
    """The call at ``start`` and the index after it; None for a call still being written."""
    pos = start + len(TOOL_CALL) if text.startswith(TOOL_CALL, start) else start
    function = _FUNCTION.match(text, pos)
    if function is None:
        close = text.find(END_TOOL_CALL, pos)
        if close == -1 and not is_final:
            return RawCall(text[start:]), None  # the function tag may still come
        end = len(text) if close == -1 else close + len(END_TOOL_CALL)
        return RawCall.invalid(text[start:end], None, f"expected {FUNCTION}name> after {TOOL_CALL}"), end
    name, pos = function.group(1).strip(), function.end()
    arguments: dict = {}
    error = None
    while (parameter := _PARAMETER.match(text, pos)) is not None:
        key = parameter.group(1).strip()
        if key in arguments and error is None:
            error = f"duplicate parameter {key!r}"
        if error is None:
            arguments[key] = _value(parameter.group(2))
        pos = parameter.end()
    end = _FUNCTION_END.match(text, pos)
    if end is not None:
        raw = text[start:end.end()]
        return (RawCall.invalid(raw, name, error) if error else RawCall.valid(raw, name, arguments)), end.end()
    if not is_final:  # the parameters read so far are settled; "}" only once </function> comes
        return RawCall(text[start:], name, json.dumps(arguments)[:-1] if name else ""), None
    return RawCall.invalid(text[start:], name or None, error or "the call was not closed with </function>"), len(text)


def _value(text: str):
    """A parameter's text: one newline either side is layout; JSON other than a string is that value."""
    text = text.removeprefix("\n").removesuffix("\n")
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value
