"""Tool-call parsers: split a model's output into content and tool calls, whole or while it streams.

>>> from hearth_llm.engine.tool_parsers import get_tool_parser, select_tool_parser
>>> parser = get_tool_parser(select_tool_parser(chat_template=tokenizer.chat_template))()
>>> parsed = parser.parse(text)                   # ParsedOutput(content, tool_calls, invalid_tool_calls)
>>> stream = parser.streamer()
>>> for piece in pieces:
...     for event in stream.feed(piece):          # ContentDelta | ToolCallDelta | InvalidToolCallDelta
...         ...
>>> stream.finish()                               # the last events

One module per format; ``base`` holds the types and the streamer, ``json_calls`` the JSON reading
that hermes, llama3_json, mistral, granite and phi4_mini share (``gemma`` reuses ``pythonic``'s).
"""
from __future__ import annotations

from .base import (ContentDelta, InvalidToolCall, InvalidToolCallDelta, ParsedOutput, StreamEvent, ToolCall,
                   ToolCallDelta, ToolCallStreamer, ToolParser, arguments_json)
from .gemma import GemmaToolParser
from .hermes import HermesToolParser
from .json_list import GraniteToolParser, Phi4MiniToolParser
from .llama3_json import Llama3JsonToolParser
from .mistral import MistralToolParser
from .pythonic import PythonicToolParser
from .qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
                   Qwen3CoderToolParser, GraniteToolParser, Phi4MiniToolParser, GemmaToolParser)
}

# What a chat template shows about the format it asks for, most specific first.
_TEMPLATE_HINTS = (
    ("[TOOL_CALLS]", "mistral"),
    ("<function=", "qwen3_coder"),      # Qwen3-Coder's template also shows <tool_call>
    ("<|tool_call|>", "granite"),
    ("<|tool|>", "phi4_mini"),
    ("<tool_call>", "hermes"),
    ("tool_code", "gemma"),             # a template that asks for ```tool_code blocks
    ("[func_name1(", "pythonic"),
    ("<|python_start|>", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": dictionary of argument name and its value', "llama3_json"),
)
_MODEL_TYPE_PARSERS = {"mistral": "mistral", "mixtral": "mistral", "pixtral": "mistral", "mistral3": "mistral",
                       "llama4": "pythonic"}
DEFAULT_TOOL_PARSER = "hermes"


def get_tool_parser(tool_parser: str) -> type[ToolParser]:
    """The parser class for a format name.

    >>> get_tool_parser("mistral")().parse("[TOOL_CALLS]get_time{}").tool_calls[0].name
    'get_time'
    """
    try:
        return TOOL_PARSERS[tool_parser]
    except (KeyError, TypeError):
        raise ValueError(f"tool_parser must be one of {sorted(TOOL_PARSERS)}; got {tool_parser!r}") from None


def select_tool_parser(chat_template: str | None = None, model_type: str | None = None) -> str:
    """The format a model most likely emits: read from its chat template, else its ``model_type``,
    else ``"hermes"`` (the ChatML convention).

    >>> select_tool_parser(chat_template="...{{- '[TOOL_CALLS]' + tool_calls | tojson }}...")
    'mistral'
    >>> select_tool_parser(model_type="qwen2")
    'hermes'
    """
    for hint, tool_parser in _TEMPLATE_HINTS:
        if chat_template and hint in chat_template:
            return tool_parser
    return _MODEL_TYPE_PARSERS.get((model_type or "").lower(), DEFAULT_TOOL_PARSER)


__all__ = ["get_tool_parser", "select_tool_parser", "TOOL_PARSERS", "DEFAULT_TOOL_PARSER", "ToolParser",
           "ToolCallStreamer", "ParsedOutput", "ToolCall", "InvalidToolCall", "ContentDelta", "ToolCallDelta",
           "InvalidToolCallDelta", "StreamEvent", "arguments_json", "HermesToolParser", "Llama3JsonToolParser",
           "MistralToolParser", "PythonicToolParser", "Qwen3CoderToolParser", "GraniteToolParser",
           "Phi4MiniToolParser", "GemmaToolParser"]
