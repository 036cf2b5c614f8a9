"""Mistral format, in its two generations:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   (tokenizer < v11)
    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}                         (v11 and later)

v11+ tokenizers may also show ``[ARGS]`` (and ``[CALL_ID]id``) between the name and the arguments.
"""
from __future__ import annotations

import random
import re
import string

from .base import RawCall, Segment, ToolParser, content_tail
from .json_calls import (complete_json_arguments, find_outside_json_strings, json_call_sequence,
                         settled_json_prefix)

TOOL_CALLS = "[TOOL_CALLS]"
_NAME = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*\w*\s*)?(?:\[ARGS\])?\s*")
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    """Both Mistral formats; text before the first ``[TOOL_CALLS]`` is content. Call ids are 9
    alphanumeric characters, as Mistral's chat templates require.

    >>> MistralToolParser().parse('[TOOL_CALLS]get_weather{"city": "Paris"}').tool_calls
    [ToolCall(id='aB3dE5gH7', name='get_weather', arguments={'city': 'Paris'})]
    """

    name = "mistral"

    def make_call_id(self) -> str:
        return "".join(random.choices(_ID_ALPHABET, k=9))

    def split(self, text: str, is_final: bool) -> list[Segment]:
        start = text.find(TOOL_CALLS)
        if start == -1:
            content = content_tail(text, after_call=False, is_final=is_final, markers=(TOOL_CALLS,))
            return [content] if content else []
        content = text[:start].rstrip()
        calls = _calls_after_marker(text[start + len(TOOL_CALLS):], is_final)
        return ([content] if content else []) + calls


def _calls_after_marker(text: str, is_final: bool) -> list[Segment]:
    body = text.lstrip()
    if body.startswith("["):
        calls = json_call_sequence(body[1:], is_final=is_final, separator=",", closer="]")
    elif body:
        pieces = _split_outside_strings(text)
        calls = [_named_call(piece, is_open=not is_final and index == len(pieces) - 1)
                 for index, piece in enumerate(pieces)]
    else:
        calls = []
    if is_final and not any(isinstance(call, RawCall) for call in calls):
        calls.insert(0, RawCall.invalid(text.strip(), None, f"no tool call after {TOOL_CALLS}"))
    return calls


def _split_outside_strings(text: str) -> list[str]:
    """``name{...}[TOOL_CALLS]name{...}`` cut into calls; a marker inside an argument string is text."""
    pieces, pos = [], 0
    while (end := find_outside_json_strings(text, pos, (TOOL_CALLS,))) != -1:
        pieces.append(text[pos:end])
        pos = end + len(TOOL_CALLS)
    return pieces + [text[pos:]]


def _named_call(piece: str, is_open: bool) -> RawCall:
    """One v11+ call: ``name{...}``."""
    match = _NAME.match(piece)
    name = match.group(1) if match else None
    arguments_text = piece[match.end():] if match else ""
    if is_open:
        if name is None or not arguments_text.startswith("{"):
            return RawCall(piece)  # the name may still grow
        return RawCall(piece, name, settled_json_prefix(arguments_text))
    if name is None or not arguments_text.startswith("{"):
        return RawCall.invalid(piece, name, "expected a function name followed by its JSON arguments")
    arguments, error = complete_json_arguments(arguments_text)
    return RawCall.invalid(piece, name, error) if error else RawCall.valid(piece, name, arguments)
