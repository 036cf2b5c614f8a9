"""What the chat service hands back: a ``ChatDelta`` per engine output while it streams, and the
``ChatResult`` of the whole answer (carried by the last delta).

Tool calls are the parsers' own types (:mod:`..tool_parsers`); log-probabilities are entries in
OpenAI's chat format, ``{"token", "bytes", "logprob", "top_logprobs": [...]}``, which every
integration passes on as is.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..outputs import Logprob, Usage
from ..tool_parsers import InvalidToolCall, InvalidToolCallDelta, ToolCall, ToolCallDelta


@dataclass(slots=True)
class ChatUsage(Usage):
    """A chat answer's token counts; ``reasoning_tokens`` of the completion were thinking.

    >>> ChatUsage(prompt_tokens=20, completion_tokens=50, reasoning_tokens=32).total_tokens
    70
    """

    reasoning_tokens: int = 0


@dataclass(slots=True)
class ChatResult:
    """A finished chat answer.

    >>> result = ChatService(get_engine("default")).chat(ChatRequest(messages))
    >>> result.content, result.finish_reason, result.usage.completion_tokens
    ('The capital of France is Paris.', 'stop', 8)

    ``content`` is the text meant for the user (tool-call markup and the think block taken out);
    ``reasoning`` the think block's text; ``text`` the model's output as generated (with a think
    block closed at ``max_reasoning_tokens``, the closing tag that was inserted included).
    ``logprobs`` is None unless asked for. ``usage`` is a :class:`ChatUsage` (``reasoning_tokens``).
    """

    content: str
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)
    usage: Usage | None = None             # the whole request's: with n > 1, every answer's tokens
    finish_reason: str | None = None       # "stop" | "length" | "abort"
    stop_reason: str | int | None = None   # the stop string or token that ended it
    logprobs: list[dict] | None = None
    prompt: str | None = None              # the prompt text as the chat template rendered it
    reasoning: str = ""                    # the think block's text (thinking models), out of ``content``

    @property
    def is_truncated(self) -> bool:
        """Whether generation stopped at ``max_tokens`` or the context's end, not where the model (or
        its grammar) ended it: a JSON answer or a tool call may then be incomplete."""
        return self.finish_reason == "length"


@dataclass(slots=True)
class ChatDelta:
    """What one engine output added to a streamed answer.

    >>> for delta in service.stream(request):
    ...     print(delta.content, end="")          # delta.result is set on the last one

    With ``n > 1`` answers, deltas of the ``n`` answers interleave (``index`` says whose), and each
    answer's last delta carries that answer's result.
    """

    text: str                                            # the model's new text, markup included
    content: str                                         # the new user-facing text
    tool_calls: list[ToolCallDelta | InvalidToolCallDelta] = field(default_factory=list)
    logprobs: list[dict] | None = None
    result: ChatResult | None = None                     # on the last delta (of its answer, when n > 1)
    index: int = 0                                       # which of the n answers
    reasoning: str = ""                                  # the new thinking text (comes before content)

    @property
    def is_last(self) -> bool:
        return self.result is not None


def logprob_entry(token_id: int, entries: dict[int, Logprob], num_top_logprobs: int) -> dict:
    """One generated token's log-probability and its ``num_top_logprobs`` best alternatives, in
    OpenAI's chat format.

    >>> logprob_entry(5, {5: Logprob(-0.1, 1, "Paris"), 7: Logprob(-2.3, 2, "Lyon")}, 1)
    {'token': 'Paris', 'bytes': [80, 97, 114, 105, 115], 'logprob': -0.1, 'top_logprobs': [...]}
    """
    chosen = entries[token_id]
    top = sorted((entry for entry in entries.values() if entry.rank <= num_top_logprobs), key=lambda e: e.rank)
    return {**_token(chosen), "top_logprobs": [_token(entry) for entry in top]}


def _token(entry: Logprob) -> dict:
    text = entry.decoded_token or ""
    return {"token": entry.decoded_token, "bytes": list(text.encode()), "logprob": entry.logprob}
