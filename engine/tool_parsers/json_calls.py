"""Tool calls written as JSON (hermes, llama3_json, mistral): the final parse of a call, and the part
of a call still being written that can no longer change.

Streamed arguments are the canonical serialization (``json.dumps``) of the arguments, written out
only as far as the model's text has settled it: a string up to its last complete character, a
number once a character after it shows it has ended, a ``}`` only once the model wrote it. Nothing
is auto-closed, so no fragment ever has to be taken back.

>>> open_json_call('{"name": "get_weather", "arguments": {"city": "Par').arguments_prefix
'{"city": "Par'
>>> complete_json_call('{"name": "get_weather", "arguments": {"city":"Paris"}}').arguments_prefix
'{"city": "Paris"}'
"""
from __future__ import annotations

import json
import re

from .base import RawCall, Segment

ARGUMENT_KEYS = ("arguments", "parameters")  # llama3 writes "parameters", everyone else "arguments"

_WHITESPACE = " \t\n\r"
_STRING_BODY = re.compile(r'[^"\\]*(?:(?:\\[^u]|\\u[0-9a-fA-F]{4})[^"\\]*)*', re.DOTALL)  # complete escapes only
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NUMBER_CHARS = re.compile(r"[-+.eE0-9]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?\Z")
_BRACKET_OR_QUOTE = re.compile(r'[{}\[\]"]')


class _Stop(Exception):
    """The text ends (or goes wrong) here; what was written out so far stands."""


# ---- the final parse ------------------------------------------------------------------------------

def complete_json_call(raw: str) -> RawCall:
    """A finished ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``) call, valid or not."""
    try:
        call = _loads(raw)
    except (ValueError, RecursionError) as error:
        return RawCall.invalid(raw, open_json_call(raw).name, f"invalid JSON: {error}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return RawCall.invalid(raw, None, 'expected a JSON object with a "name" string')
    keys = [key for key in ARGUMENT_KEYS if key in call]
    if len(keys) > 1:
        return RawCall.invalid(raw, call["name"], 'has both "arguments" and "parameters"')
    arguments = call[keys[0]] if keys else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments, error = complete_json_arguments(arguments)
        if error:
            return RawCall.invalid(raw, call["name"], error)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return RawCall.invalid(raw, call["name"], f"arguments must be a JSON object, got {type(arguments).__name__}")
    return RawCall.valid(raw, call["name"], arguments)


def complete_json_arguments(text: str) -> tuple[dict | None, str | None]:
    """``(arguments, None)`` for text holding one JSON object, else ``(None, error)``."""
    try:
        arguments = _loads(text)
    except (ValueError, RecursionError) as error:
        return None, f"invalid JSON arguments: {error}"
    if not isinstance(arguments, dict):
        return None, f"arguments must be a JSON object, got {type(arguments).__name__}"
    return arguments, None


def _loads(text: str):
    # strict=False: models put raw newlines and tabs inside strings (code, addresses).
    return json.loads(text, strict=False, object_pairs_hook=_reject_duplicate_keys)


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        # The stream may already have sent the first value; keeping either would break one path.
        duplicate = next(key for index, (key, _) in enumerate(pairs) if key in dict(pairs[:index]))
        raise ValueError(f"duplicate key {duplicate!r}")
    return result


# ---- the settled part of a call still being written ----------------------------------------------

def open_json_call(raw: str) -> RawCall:
    """A call still being written: its name once complete, and its arguments' settled prefix."""
    name, arguments_out = None, []
    try:
        pos = _expect(raw, 0, "{")
        while True:
            key_out: list[str] = []
            pos = _string(raw, _skip_whitespace(raw, pos), key_out)
            key = json.loads(key_out[0])
            pos = _expect(raw, pos, ":")
            # Arguments stream only after the name, and only as an object (not as a JSON string).
            is_object = raw[_skip_whitespace(raw, pos):].startswith("{")
            if key == "name" and name is None:
                value_out: list[str] = []
                pos = _value(raw, pos, value_out)
                value = json.loads(value_out[0])
                name = value if isinstance(value, str) and value else None
            elif key in ARGUMENT_KEYS and name is not None and not arguments_out and is_object:
                pos = _value(raw, pos, arguments_out)
            else:
                pos = _value(raw, pos, [])
            pos = _expect(raw, pos, ",")
    except (_Stop, RecursionError, ValueError):
        pass
    return RawCall(raw, name, "".join(arguments_out))


def settled_json_prefix(text: str) -> str:
    """The canonical serialization of the JSON value that ``text`` begins, as far as it is settled.

    >>> settled_json_prefix('{"a":[1,2')
    '{"a": [1, '
    """
    out: list[str] = []
    try:
        _value(text, 0, out)
    except (_Stop, RecursionError, ValueError):
        pass
    return "".join(out)


def _value(text: str, pos: int, out: list[str]) -> int:
    pos = _skip_whitespace(text, pos)
    char = text[pos:pos + 1]
    if char == "{":
        return _container(text, pos, out, "}", is_object=True)
    if char == "[":
        return _container(text, pos, out, "]", is_object=False)
    if char == '"':
        return _string(text, pos, out)
    for literal in ("true", "false", "null"):
        if text.startswith(literal, pos):
            out.append(literal)
            return pos + len(literal)
    return _number(text, pos, out)


def _container(text: str, pos: int, out: list[str], closer: str, is_object: bool) -> int:
    out.append(text[pos])
    pos = _skip_whitespace(text, pos + 1)
    if text[pos:pos + 1] == closer:
        out.append(closer)
        return pos + 1
    while True:
        if is_object:
            pos = _string(text, _skip_whitespace(text, pos), out)
            pos = _expect(text, pos, ":")
            out.append(": ")
        pos = _skip_whitespace(text, _value(text, pos, out))
        char = text[pos:pos + 1]
        if char == ",":
            out.append(", ")
            pos += 1
        elif char == closer:
            out.append(closer)
            return pos + 1
        else:
            raise _Stop


def _string(text: str, pos: int, out: list[str]) -> int:
    if text[pos:pos + 1] != '"':
        raise _Stop
    end = _STRING_BODY.match(text, pos + 1).end()  # stops before an escape that is not complete yet
    is_closed = text[end:end + 1] == '"'
    out.append(_reencode(text[pos + 1:end], is_closed))
    if not is_closed:
        raise _Stop
    return end + 1


def _reencode(raw_body: str, is_closed: bool) -> str:
    try:
        encoded = json.dumps(json.loads(f'"{raw_body}"', strict=False))
    except ValueError:
        raise _Stop from None
    return encoded if is_closed else encoded[:-1]


def _number(text: str, pos: int, out: list[str]) -> int:
    end = _NUMBER_CHARS.match(text, pos).end()
    if end == len(text) or not _NUMBER.match(text[pos:end]):
        raise _Stop  # more digits may follow; or not a number at all
    out.append(json.dumps(json.loads(text[pos:end])))
    return end


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _expect(text: str, pos: int, char: str) -> int:
    pos = _skip_whitespace(text, pos)
    if text[pos:pos + 1] != char:
        raise _Stop
    return pos + 1


# ---- calls written one after another -------------------------------------------------------------

def find_json_end(text: str, pos: int) -> int | None:
    """The index just past the bracketed value starting at ``text[pos]``, or None while it is open."""
    depth = 0
    while match := _BRACKET_OR_QUOTE.search(text, pos):
        char, pos = match.group(), match.end()
        if char == '"':
            rest = _STRING_REST.match(text, pos)
            if rest is None:
                return None
            pos = rest.end()
        elif char in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return pos
    return None


def find_outside_json_strings(text: str, pos: int, needles: tuple[str, ...]) -> int:
    """The index of the first needle at or after ``pos`` that is not inside a JSON string; -1 if none
    (or while a string is still open)."""
    pattern = re.compile("|".join(re.escape(needle) for needle in ('"',) + needles))
    while match := pattern.search(text, pos):
        if match.group() != '"':
            return match.start()
        rest = _STRING_REST.match(text, match.end())
        if rest is None:
            return -1
        pos = rest.end()
    return -1


def json_call_sequence(text: str, *, is_final: bool, separator: str, closer: str | None = None) -> list[Segment]:
    """Calls written as JSON objects one after another: ``{...}; {...}`` (llama3) or the inside of
    ``[{...}, {...}]`` (mistral), followed by content (after ``closer`` when there is one)."""
    segments: list[Segment] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos] in _WHITESPACE or text[pos] == separator):
            pos += 1
        if pos == len(text):
            return segments
        if text[pos] == "{":
            end = find_json_end(text, pos)
            if end is None:
                segments.append(complete_json_call(text[pos:]) if is_final else open_json_call(text[pos:]))
                return segments
            segments.append(complete_json_call(text[pos:end]))
            pos = end
        elif closer is not None and text[pos] == closer:
            return segments + [text[pos + 1:].lstrip()]
        elif closer is None and segments:
            return segments + [text[pos:]]
        else:
            if is_final:
                segments.append(RawCall.invalid(text[pos:].strip(), None, "expected a JSON object"))
            return segments
