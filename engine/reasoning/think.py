"""Think blocks: ``<think>…</think>`` (Qwen3, SmolLM3, DeepSeek-R1 and its distills, Phi-4-reasoning)
and Magistral's ``[THINK]…[/THINK]``.

    <think>
    The user wants the capital of France. That is Paris.
    </think>

    The capital of France is Paris.
"""
from __future__ import annotations

from .base import ParsedReasoning, ReasoningParser, partial_tag_len


class ThinkReasoningParser(ReasoningParser):
    """One think block at the start of the output; the text after it is the answer.

    An output that does not open the block (Qwen3 with ``enable_thinking=False``) is all answer; a
    block never closed (the budget or ``max_tokens`` ran out) is all reasoning. With
    ``starts_in_reasoning`` the prompt opened the block, and a repeated opening tag is dropped.

    >>> ThinkReasoningParser().parse("<think>Easy.</think>\\n\\nParis.")
    ParsedReasoning(reasoning='Easy.', content='Paris.', is_reasoning_done=True)
    >>> ThinkReasoningParser().parse("Paris.")
    ParsedReasoning(reasoning='', content='Paris.', is_reasoning_done=True)
    """

    name = "think"
    start_tag = "<think>"
    end_tag = "</think>"

    def split(self, text: str, is_final: bool) -> ParsedReasoning:
        lead = text.lstrip()
        if lead.startswith(self.start_tag):
            body_start = len(text) - len(lead) + len(self.start_tag)
        elif not is_final and self.start_tag.startswith(lead):
            return ParsedReasoning("", "", False)  # the opening tag may still come: nothing is certain
        elif self.starts_in_reasoning:
            body_start = 0
        else:
            return ParsedReasoning("", text, True)  # no think block: all answer
        end = text.find(self.end_tag, body_start)
        if end != -1:
            return ParsedReasoning(text[body_start:end].strip(), text[end + len(self.end_tag):].lstrip(), True)
        body = text[body_start:]
        if not is_final:
            body = body[:len(body) - partial_tag_len(body, self.end_tag)].rstrip()
        return ParsedReasoning(body.strip(), "", False)


class MistralReasoningParser(ThinkReasoningParser):
    """Magistral's ``[THINK]…[/THINK]``.

    >>> MistralReasoningParser().parse("[THINK]Easy.[/THINK]Paris.").content
    'Paris.'
    """

    name = "mistral"
    start_tag = "[THINK]"
    end_tag = "[/THINK]"
