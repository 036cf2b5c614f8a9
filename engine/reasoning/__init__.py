"""Reasoning parsers: split a thinking model's output into its reasoning and its answer, whole or
while it streams.

>>> from hearth_llm.engine.reasoning import get_reasoning_parser, select_reasoning_parser
>>> parser = get_reasoning_parser(select_reasoning_parser(chat_template=tokenizer.chat_template))()
>>> parser.parse("<think>Easy.</think>Paris.")     # ParsedReasoning(reasoning, content, is_reasoning_done)
>>> stream = parser.streamer()
>>> for piece in pieces:
...     new_reasoning, new_content = stream.feed(piece)
>>> stream.finish()

One module per format family; ``base`` holds the types and the streamer, ``template`` what a
chat template says about thinking (its on/off switch, whether it opens the block itself).
"""
from __future__ import annotations

from .base import ParsedReasoning, ReasoningParser, ReasoningStreamer
from .template import prompt_opens_block, template_opens_block, thinking_switch
from .think import MistralReasoningParser, ThinkReasoningParser

# Names as vLLM's --reasoning-parser spells them where they share a format.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "think": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
    "deepseek_r1": ThinkReasoningParser,
    "mistral": MistralReasoningParser,
}

# What a chat template shows about the format its model thinks in, most specific first.
_TEMPLATE_HINTS = (("[THINK]", "mistral"), ("</think>", "think"), ("<think>", "think"))


def get_reasoning_parser(reasoning_parser: str) -> type[ReasoningParser]:
    """The parser class for a format name.

    >>> get_reasoning_parser("deepseek_r1")(starts_in_reasoning=True).parse("Hm.</think>Yes.").content
    'Yes.'
    """
    try:
        return REASONING_PARSERS[reasoning_parser]
    except (KeyError, TypeError):
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}; "
                         f"got {reasoning_parser!r}") from None


def select_reasoning_parser(chat_template: str | None) -> str | None:
    """The format a model thinks in, read from its chat template; None for a model that does not think.

    >>> select_reasoning_parser("{%- if enable_thinking is false %}<think>\\n\\n</think>{% endif %}")
    'think'
    >>> select_reasoning_parser("{{ messages }}") is None
    True
    """
    for hint, reasoning_parser in _TEMPLATE_HINTS:
        if chat_template and hint in chat_template:
            return reasoning_parser
    return None


__all__ = ["get_reasoning_parser", "select_reasoning_parser", "REASONING_PARSERS", "ReasoningParser",
           "ReasoningStreamer", "ParsedReasoning", "ThinkReasoningParser", "MistralReasoningParser",
           "thinking_switch", "prompt_opens_block", "template_opens_block"]
