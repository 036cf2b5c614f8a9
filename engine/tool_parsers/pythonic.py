"""Pythonic format (Llama 3.2/4 with pythonic templates, several small models): a Python list of calls.

    [get_weather(city='San Francisco', unit='celsius'), get_time(timezone="PST")]

The text is read with ``ast`` and only literal values are accepted (strings, numbers, booleans,
None, and lists, tuples and dicts of them). Nothing is ever evaluated, so
``[f(a=__import__('os').system('x'))]`` is an invalid call, not a command.
"""
from __future__ import annotations

import ast
import re
import warnings
from typing import Iterator

from .base import RawCall, Segment, ToolParser, arguments_json

_CALL_LIST_START = re.compile(r"\s*\[\s*[A-Za-z_][\w.]*\s*\(")
_CALL_LIST_START_PREFIX = re.compile(r"\s*(?:\[\s*(?:[A-Za-z_][\w.]*\s*)?)?")
_CALL_HEAD = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_STRUCTURE = re.compile(r"""[()\[\]{},'"]""")
_STRING_REST = {quote: re.compile(rf"[^{quote}\\]*(?:\\.[^{quote}\\]*)*{quote}", re.DOTALL) for quote in "'\""}
_JSON_NAMES = {"true": True, "false": False, "null": None}  # models trained on JSON write these too


class _NotLiteral(ValueError):
    pass


class PythonicToolParser(ToolParser):
    """``[f(a='x'), g(b=1)]`` as the whole output (text after the closing ``]`` is content); anything
    else is plain content.

    >>> PythonicToolParser().parse("[get_weather(city='Paris', days=-1, hourly=None)]").tool_calls
    [ToolCall(id='call_...', name='get_weather', arguments={'city': 'Paris', 'days': -1, 'hourly': None})]
    """

    name = "pythonic"

    def split(self, text: str, is_final: bool) -> list[Segment]:
        if not _CALL_LIST_START.match(text):
            if not is_final and _CALL_LIST_START_PREFIX.fullmatch(text):
                return []  # still might open a call list
            return [text] if text else []
        segments: list[Segment] = []
        item_start = text.index("[") + 1
        depth = 0
        for pos, char in _structure(text, item_start):
            if char in "([{":
                depth += 1
            elif depth > 0:
                if char != ",":
                    depth -= 1
            else:  # a comma or closer at the list's own level ends an item
                if text[item_start:pos].strip():  # [f(), ] is fine Python
                    segments.append(_complete_call(text[item_start:pos]))
                item_start = pos + 1
                if char != ",":
                    rest = text[item_start:].lstrip()
                    return segments + ([rest] if rest else [])
        item = text[item_start:]
        if item.strip():  # the list is not closed (yet)
            segments.append(_complete_call(item) if is_final else _open_call(item))
        return segments


def _structure(text: str, pos: int) -> Iterator[tuple[int, str]]:
    """Brackets and commas outside string literals, from ``pos``; stops inside an unclosed string."""
    while match := _STRUCTURE.search(text, pos):
        char, pos = match.group(), match.end()
        if char in "'\"":
            rest = _STRING_REST[char].match(text, pos)
            if rest is None:
                return
            pos = rest.end()
        else:
            yield match.start(), char


def _complete_call(item: str) -> RawCall:
    source = item.strip()
    head = _CALL_HEAD.match(source)
    name = head.group(1) if head else None
    try:
        with warnings.catch_warnings():  # "invalid escape sequence" for a regex like '\d+' is not our business
            warnings.simplefilter("ignore")
            call = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        return RawCall.invalid(source, name, f"not a Python call: {error}")
    if not isinstance(call, ast.Call) or name is None:
        return RawCall.invalid(source, name, "expected a call like name(arg=value)")
    if call.args:
        return RawCall.invalid(source, name, "positional arguments are not supported; expected name(arg=value)")
    arguments = {}
    try:
        for keyword in call.keywords:
            if keyword.arg is None:
                raise _NotLiteral("**kwargs is not supported")
            if keyword.arg in arguments:
                raise _NotLiteral(f"argument {keyword.arg!r} is repeated")
            arguments[keyword.arg] = _literal(keyword.value)
        return RawCall.valid(source, name, arguments)
    except (_NotLiteral, RecursionError, ValueError) as error:  # ValueError: an int too long to print
        return RawCall.invalid(source, name, str(error))


def _literal(node: ast.AST):
    """The value of a literal expression; anything that would need evaluating is refused."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, type(None))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise _NotLiteral("dict keys must be strings")
        return {key: _literal(value) for key, value in zip(keys, node.values)}
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotLiteral(f"{ast.unparse(node)!r} is not a literal value")


def _open_call(item: str) -> RawCall:
    """A call still being written: its name once ``name(`` is there; its arguments as far as the
    keyword arguments written so far are complete."""
    head = _CALL_HEAD.match(item)
    if head is None:
        return RawCall(item.strip())
    settled_end, is_closed, depth = head.end(), False, 0
    for pos, char in _structure(item, head.end()):
        if char in "([{":
            depth += 1
        elif depth > 0:
            if char != ",":
                depth -= 1
        else:
            settled_end, is_closed = pos, char != ","
            if is_closed:
                break
    settled = _complete_call(f"{head.group(1)}({item[head.end():settled_end]})")
    if settled.error is not None:
        return RawCall(item.strip(), head.group(1))
    settled_json = arguments_json(settled.arguments)
    return RawCall(item.strip(), head.group(1), settled_json if is_closed else settled_json[:-1])
