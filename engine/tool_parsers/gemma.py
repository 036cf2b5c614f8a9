"""Gemma 3's fenced function-call format: Python calls in a ```tool_code block, text around them.

    I'll look both up.
    ```tool_code
    get_weather(city='Paris', days=3)
    get_time(timezone="Europe/Paris")
    ```

Calls in a block are separated by newlines or commas (a Python list ``[f(), g()]`` works too);
there may be several blocks. Results go back to the model as a ```tool_output block, which is the
chat template's business. The arguments are read like the pythonic format's: only literals,
nothing is evaluated. A block whose closing fence never came (cut by ``max_tokens``) still yields
the calls written whole; a call cut inside its parentheses is invalid.

FunctionGemma's ``<start_function_call>call:name{...}<end_function_call>`` is another format,
not read here.
"""
from __future__ import annotations

import re
from typing import Iterator

from .base import RawCall, Segment, ToolParser, content_tail, strip_around_calls
from .pythonic import _STRING_REST, PythonicToolParser, _complete_call, _open_call

TOOL_CODE, FENCE = "```tool_code", "```"
# Inside a block: brackets, item separators and the closing fence, outside string literals.
_BLOCK_STRUCTURE = re.compile(r"""```|[()\[\]{},\n'"]""")


class GemmaToolParser(ToolParser):
    """```` ```tool_code\\nname(arg=value, ...)\\n``` ````, any number of calls and blocks; text
    outside the blocks is content.

    >>> GemmaToolParser().parse("Sure.\\n```tool_code\\nget_time(timezone='UTC')\\n```").tool_calls
    [ToolCall(id='call_...', name='get_time', arguments={'timezone': 'UTC'})]
    """

    name = "gemma"

    def split(self, text: str, is_final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while (start := text.find(TOOL_CODE, pos)) != -1:
            segments.append(strip_around_calls(text[pos:start], after_call=pos > 0, before_call=True))
            calls, end = _read_block(text, start + len(TOOL_CODE), is_final)
            segments += calls
            if end is None:  # the block is still being written
                return [segment for segment in segments if segment != ""]
            pos = end
        segments.append(content_tail(text[pos:], after_call=pos > 0, is_final=is_final, markers=(TOOL_CODE,)))
        return [segment for segment in segments if segment != ""]


def _read_block(text: str, pos: int, is_final: bool) -> tuple[list[RawCall], int | None]:
    """The calls of the block whose body starts at ``pos``, and the index after its closing fence;
    None while the block is open and more text may come."""
    calls: list[RawCall] = []
    item_start, depth = pos, 0
    for at, token in _block_tokens(text, pos):
        if token in "([{":
            depth += 1
        elif token in ")]}":
            depth = max(depth - 1, 0)
        elif depth == 0 or token == FENCE:  # a separator at the top level, or the end of the block
            calls += _complete_item(text[item_start:at])
            item_start = at + len(token)
            if token == FENCE:
                return calls, item_start
    # No closing fence (yet): the last item runs to the end of the text.
    item = text[item_start:]
    if is_final:
        last = [call if call.error is None else RawCall.invalid(call.raw, call.name, f"{call.error}; the tool_code "
                                                                "block ended without its closing ```")
                for call in _complete_item(item)]
        return calls + last, len(text)
    if _could_be_fence_start(item):
        item = item.rstrip("`")
    return calls + _open_item(item), None


def _block_tokens(text: str, pos: int) -> Iterator[tuple[int, str]]:
    """Brackets, commas, newlines and fences outside string literals; stops inside an unclosed string."""
    while match := _BLOCK_STRUCTURE.search(text, pos):
        token, pos = match.group(), match.end()
        if token in "'\"":
            rest = _STRING_REST[token].match(text, pos)
            if rest is None:
                return
            pos = rest.end()
        else:
            yield match.start(), token


def _could_be_fence_start(item: str) -> bool:
    return item.endswith("`") and not item.endswith(FENCE)


def _complete_item(item: str) -> list[RawCall]:
    source = item.strip()
    if not source:
        return []
    if source.startswith("["):  # a pythonic list of calls inside the block
        calls = [segment for segment in PythonicToolParser().split(source, is_final=True)
                 if isinstance(segment, RawCall)]
        return calls or [RawCall.invalid(source, None, "expected calls like name(arg=value) in the tool_code block")]
    return [_complete_call(source)]


def _open_item(item: str) -> list[RawCall]:
    source = item.strip()
    if not source:
        return []
    if source.startswith("["):
        calls = [segment for segment in PythonicToolParser().split(source, is_final=False)
                 if isinstance(segment, RawCall)]
        return calls or [RawCall(source)]
    return [_open_call(source)]
