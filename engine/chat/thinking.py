"""A thinking answer in two engine requests, when the think block needs what one request cannot
give: a token budget (``max_reasoning_tokens``), or a grammar that must start after the block.

1. *Thinking*: the prompt with the think block open, no grammar, ``max_tokens`` = the budget,
   stopped by the closing tag. The model closes the block itself, or the budget runs out and the
   closing tag is inserted (``"\\n</think>\\n\\n"``, as the model would write it).
2. *Answer*: prompt + thinking + closing tag as token ids, the caller's grammar, stop strings and
   what is left of ``max_tokens``. Its prompt is the first request's tokens, so the prefix cache
   holds all but its last block: the second prefill is a few tokens, not the whole conversation.

:class:`ThinkingStream` reads like one request's stream: the first request's last output is
relayed as a plain delta, the inserted tag as a delta with no tokens, and the last output carries
both requests' usage and the first one's prompt.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..outputs import StreamOutput, Usage
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..engine_core import EngineCore
    from ..streams import RequestStream


@dataclass(slots=True)
class ThinkingPlan:
    """How one request thinks and then answers (see the module docstring)."""

    thinking_params: SamplingParams          # no grammar; stops at the closing tag or the budget
    answer_params: SamplingParams            # the caller's; ``max_tokens`` is lowered by what thinking used
    end_tag: str
    end_token_id: int | None                 # the closing tag as one token, when the vocabulary has it
    close_text: str                          # inserted when the budget runs out
    close_token_ids: list[int]
    max_reasoning_tokens: int | None

    @classmethod
    def build(cls, params: SamplingParams, max_reasoning_tokens: int | None, tokenizer, end_tag: str) -> ThinkingPlan:
        """The plan for a request sampled with ``params``; raises ``ValueError`` for ``n > 1``."""
        if params.n != 1:
            raise ValueError(f"n={params.n}: an answer that thinks first (max_reasoning_tokens, or a grammar "
                             f"after the think block) is generated one at a time; use n=1")
        end_ids = tokenizer.encode(end_tag, add_special_tokens=False)
        end_token_id = end_ids[0] if len(end_ids) == 1 else None
        limits = [limit for limit in (max_reasoning_tokens, params.max_tokens) if limit is not None]
        # The caller's stop strings end the answer, not the thinking; the closing tag ends the thinking.
        thinking = dataclasses.replace(
            params, structured_output=None, max_tokens=min(limits) if limits else None,
            stop=None if end_token_id is not None else [end_tag], include_stop_str_in_output=True,
            stop_token_ids=params.stop_token_ids + ([end_token_id] if end_token_id is not None else []))
        close_text = f"\n{end_tag}\n\n"
        return cls(thinking, params, end_tag, end_token_id, close_text,
                   tokenizer.encode(close_text, add_special_tokens=False), max_reasoning_tokens)

    def answer_after(self, finish_reason: str | None, stop_reason, num_thinking_tokens: int) -> tuple[bool, int | None]:
        """Whether the answer follows the thinking (and whether the closing tag is inserted), from how
        the thinking request ended: (insert the closing tag, the answer's ``max_tokens``); None for
        the first means no answer follows: the model stopped, was aborted, or ``max_tokens`` is spent."""
        closed = finish_reason == "stop" and stop_reason is not None and stop_reason in (self.end_token_id,
                                                                                         self.end_tag)
        limit = self.thinking_params.max_tokens
        budget_spent = (finish_reason == "length" and self.max_reasoning_tokens is not None
                        and num_thinking_tokens >= self.max_reasoning_tokens and limit == self.max_reasoning_tokens)
        if not (closed or budget_spent):
            return None, None
        max_tokens = self.answer_params.max_tokens
        if max_tokens is not None:
            max_tokens -= num_thinking_tokens + (len(self.close_token_ids) if budget_spent else 0)
            if max_tokens < 1:
                return None, None
        return budget_spent, max_tokens


class ThinkingStream:
    """The two requests of a :class:`ThinkingPlan`, read as one stream (``for`` or ``async for``).

    >>> stream = ThinkingStream(core, core.add_request(prompt, plan.thinking_params), plan, priority=0, timeout=None)
    >>> for output in stream:
    ...     print(output.delta_text, end="")      # the thinking, the closing tag, the answer

    ``close()`` aborts whichever request is running.
    """

    def __init__(self, core: EngineCore, thinking: RequestStream, plan: ThinkingPlan, priority: int,
                 timeout: float | None, request_kwargs: dict | None = None):
        self._core = core
        self._request_kwargs = request_kwargs or {}  # e.g. the LoRA adapter, for the answer request too
        self._current: RequestStream | None = thinking
        self._plan = plan
        self._priority = priority
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.request_id = thinking.request_id
        self._thinking_token_ids: list[int] = []
        self._finish: tuple[str | None, object] = (None, None)
        self._answer: tuple[list[int], SamplingParams] | None = None  # the second request, once due
        self._first_last: StreamOutput | None = None
        self._num_inserted_tokens = 0

    def __iter__(self) -> Iterator[StreamOutput]:
        while self._current is not None:
            stream = self._current
            for output in stream:
                yield from self._relay(output)
            self._current = self._start_answer()

    async def __aiter__(self) -> AsyncIterator[StreamOutput]:
        while self._current is not None:
            stream = self._current
            async for output in stream:
                for relayed in self._relay(output):
                    yield relayed
            self._current = self._start_answer()

    def close(self) -> None:
        if self._current is not None:
            self._current.close()

    def __enter__(self) -> ThinkingStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- relaying --------------------------------------------------------------------------

    def _relay(self, output: StreamOutput) -> list[StreamOutput]:
        if self._first_last is None:
            return self._relay_thinking(output)
        return [self._relay_answer(output)]

    def _relay_thinking(self, output: StreamOutput) -> list[StreamOutput]:
        self._thinking_token_ids.extend(output.delta_token_ids)
        if output.finish_reason is not None:
            self._finish = (output.finish_reason, output.stop_reason)
        if not output.finished:
            return [dataclasses.replace(output, finish_reason=None, stop_reason=None)]
        inserts_tag, max_tokens = self._plan.answer_after(*self._finish, len(self._thinking_token_ids))
        if inserts_tag is None:  # no answer follows: this is the last output, as the engine sent it
            self._current = None
            return [dataclasses.replace(output, finish_reason=self._finish[0], stop_reason=self._finish[1])]
        self._first_last = output
        relayed = [dataclasses.replace(output, finish_reason=None, stop_reason=None, finished=False, usage=None,
                                       prompt_token_ids=None, prompt_logprobs=None, prompt=None)]
        inserted = self._plan.close_token_ids if inserts_tag else []
        if inserts_tag:
            self._num_inserted_tokens = len(inserted)
            relayed.append(StreamOutput(self.request_id, self._plan.close_text, []))
        prompt = list(output.prompt_token_ids or []) + self._thinking_token_ids + inserted
        if len(prompt) >= self._core.model_info.max_model_len:  # thinking filled the context: cut, like any answer
            self._current = None
            return [dataclasses.replace(output, finish_reason="length", stop_reason=None)]
        self._answer = (prompt, dataclasses.replace(self._plan.answer_params, max_tokens=max_tokens))
        return relayed

    def _relay_answer(self, output: StreamOutput) -> StreamOutput:
        if not output.finished:
            return dataclasses.replace(output, request_id=self.request_id)
        first = self._first_last
        usage = None
        if first.usage is not None and output.usage is not None:
            usage = Usage(prompt_tokens=first.usage.prompt_tokens, cached_tokens=first.usage.cached_tokens,
                          completion_tokens=first.usage.completion_tokens + self._num_inserted_tokens
                          + output.usage.completion_tokens)
        return dataclasses.replace(output, request_id=self.request_id, usage=usage, prompt=first.prompt,
                                   prompt_token_ids=first.prompt_token_ids, prompt_logprobs=first.prompt_logprobs)

    def _start_answer(self) -> RequestStream | None:
        if self._answer is None:
            return None
        prompt, params = self._answer
        self._answer = None
        timeout = None if self._deadline is None else max(self._deadline - time.monotonic(), 1e-3)
        return self._core.add_request(prompt, params, f"{self.request_id}.answer", self._priority, timeout=timeout,
                                      **self._request_kwargs)
