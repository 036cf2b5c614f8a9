"""What every reasoning parser shares: the split of an output into its thinking and its answer,
whole or while it streams.

A format implements ``ReasoningParser.split(text, is_final)``; ``parse`` is ``split`` of the whole
output, and the streamer runs ``split`` on the text so far and emits only what grew. Because both
paths use one function, a stream reconstructs exactly what ``parse`` returns, at any chunking.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class ParsedReasoning:
    """An output split into the model's thinking and the answer meant for the user.

    ``is_reasoning_done`` is False while the output is still inside its think block (then more
    text can only grow ``reasoning``); True once the block closed or the output has none.

    >>> ThinkReasoningParser().parse("<think>\\nTwo and two.\\n</think>\\n\\n4")
    ParsedReasoning(reasoning='Two and two.', content='4', is_reasoning_done=True)
    """

    reasoning: str
    content: str
    is_reasoning_done: bool


class ReasoningParser:
    """Splits model output into reasoning and content; each subclass reads one format.

    ``starts_in_reasoning``: the prompt already opened the think block (DeepSeek-R1 distills'
    template ends with ``<think>\\n``; Qwen3-Thinking-2507 too), so the output begins inside it.

    >>> parser = get_reasoning_parser("qwen3")(starts_in_reasoning=True)
    >>> parser.parse("Two and two.</think>4").reasoning
    'Two and two.'
    >>> stream = parser.streamer()
    >>> stream.feed("Two and") , stream.feed(" two.</th"), stream.feed("ink>4"), stream.finish()
    (('Two and', ''), (' two.', ''), ('', '4'), ('', ''))
    """

    name: ClassVar[str]
    start_tag: ClassVar[str]
    end_tag: ClassVar[str]

    def __init__(self, starts_in_reasoning: bool = False):
        self.starts_in_reasoning = starts_in_reasoning

    def split(self, text: str, is_final: bool) -> ParsedReasoning:
        """The split of ``text`` (the output so far; all of it when ``is_final``).

        Until the output is final, hold back what may still change: a suffix that may be the start
        of a tag, whitespace that may end up next to one. Whatever is returned must stay a prefix of
        what longer text returns.
        """
        raise NotImplementedError

    def parse(self, text: str) -> ParsedReasoning:
        """Split a complete output. Never raises on malformed output."""
        return self.split(text, is_final=True)

    def streamer(self) -> ReasoningStreamer:
        """A fresh stateful splitter for one streamed output."""
        return ReasoningStreamer(self)


class ReasoningStreamer:
    """Turns the pieces of a streamed output into new reasoning and new content text.

    >>> stream = ThinkReasoningParser().streamer()
    >>> stream.feed("<think>Hm"), stream.feed("m.</think>"), stream.feed("\\n\\nYes."), stream.finish()
    (('Hm', ''), ('m.', ''), ('', 'Yes.'), ('', ''))
    """

    def __init__(self, parser: ReasoningParser):
        self._parser = parser
        self._text = ""
        self._num_reasoning_chars = 0
        self._num_content_chars = 0
        self.is_reasoning_done = False
        self._is_finished = False

    def feed(self, text: str) -> tuple[str, str]:
        """Add the next piece; returns (new reasoning, new content) that it made certain."""
        if self._is_finished:
            raise RuntimeError("feed() was called after finish(); use a new streamer() per output")
        self._text += text
        return self._emit(self._parser.split(self._text, is_final=False))

    def finish(self) -> tuple[str, str]:
        """The output is complete: flush what was held back."""
        if self._is_finished:
            return "", ""
        self._is_finished = True
        return self._emit(self._parser.split(self._text, is_final=True))

    def _emit(self, parsed: ParsedReasoning) -> tuple[str, str]:
        self.is_reasoning_done = parsed.is_reasoning_done
        reasoning = parsed.reasoning[self._num_reasoning_chars:]
        content = parsed.content[self._num_content_chars:]
        self._num_reasoning_chars = max(self._num_reasoning_chars, len(parsed.reasoning))
        self._num_content_chars = max(self._num_content_chars, len(parsed.content))
        return reasoning, content


def partial_tag_len(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
