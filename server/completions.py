"""``POST /v1/completions``: raw prompts (text or token ids, one or many) straight onto the engine,
with ``n`` samples each, ``echo`` and OpenAI's legacy log-probability format.

No chat template and no tool calls, so this maps onto ``EngineCore.add_requests`` (the public
engine API) rather than the chat service; all prompts of a request are admitted together or not at all.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import JSONResponse

from hearth_llm.engine import RequestStream, SamplingParams, StreamOutput, Usage
from hearth_llm.engine.outputs import Logprob

from .chat import usage
from .errors import APIError, engine_failure, invalid_parameter
from .ids import random_hex
from .protocol import CompletionRequest
from .sse import DONE, EventStreamResponse, event
from .state import ServerState

_FIELDS = frozenset(CompletionRequest.model_fields) | {"prompt_logprobs"}
# Fields passed to SamplingParams as they are, when set.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "stop", "min_tokens", "ignore_eos")


async def create_completion(body: CompletionRequest, request: Request):
    state: ServerState = request.app.state.hearth
    state.check_chat_model(body.model)
    prompts = _prompts(body.prompt)
    params = _sampling_params(body, state)
    reply_id = f"cmpl-{random_hex()}"
    request.state.log.update(model=body.model, user=body.user or body.safety_identifier, engine_request_id=reply_id)
    timeout = state.timeout(request)
    await state.admit(request)
    try:
        streams = await state.add_requests(prompts, [params] * len(prompts),
                                           [f"{reply_id}-{index}" for index in range(len(prompts))],
                                           [body.priority or 0] * len(prompts), timeout=timeout)
    except (ValueError, TypeError) as error:
        raise invalid_parameter(error, _FIELDS) from error
    except Exception as error:
        raise engine_failure(error) or error
    reply = _Reply(reply_id, int(time.time()), state.settings.chat_model_name, params, bool(body.echo), prompts,
                   state.core, include_usage=bool(body.stream_options and body.stream_options.include_usage))

    def close() -> None:
        for stream in streams:
            stream.close()
        state.charge(request, reply.num_tokens_used(), reply.final_usage)

    try:
        if body.stream:
            merged = _merged(streams)
            first = await _next(merged)  # an invalid prompt is still a 400 here
            return EventStreamResponse(reply.events(first, merged), on_close=close)
        outputs = await asyncio.gather(*(_read_all(stream) for stream in streams))
    except BaseException:
        close()
        raise
    response = reply.completion(outputs)
    state.charge(request, reply.final_usage.total_tokens, reply.final_usage)
    return JSONResponse(response)


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):  # the body's validation made it one of the union's lists: all ints
        return [list(prompt)]
    return list(prompt)


def _sampling_params(body: CompletionRequest, state: ServerState) -> SamplingParams:
    if body.suffix is not None:
        raise APIError(400, "suffix (insertion) is not supported", param="suffix")
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    values = {name: getattr(body, name) for name in _SAMPLING_FIELDS if getattr(body, name) is not None}
    if body.logprobs is not None:
        values["logprobs"] = body.logprobs
        if body.echo and body.stream:
            raise APIError(400, "echo with logprobs cannot stream: the prompt's log-probabilities come with the "
                                "request's end; leave out stream, echo or logprobs", param="echo")
        if body.echo:
            values["prompt_logprobs"] = body.logprobs
    try:
        return SamplingParams(n=state.check_n(body.n), max_tokens=state.max_tokens(body.max_tokens), **values)
    except (ValueError, TypeError) as error:
        raise invalid_parameter(error, _FIELDS) from error


async def _read_all(stream: RequestStream) -> list[StreamOutput]:
    try:
        return [output async for output in stream]
    except ValueError as error:
        raise invalid_parameter(error, _FIELDS) from error
    except Exception as error:
        raise engine_failure(error) or error


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamOutput]]:
    """Every stream's outputs as ``(prompt index, output)``, in the order they arrive; outputs that
    arrived together for the same choice come as one (an event loop that fell behind the engine
    sends one event for them, not one each, and so catches up instead of falling further behind)."""
    if len(streams) == 1:  # the common case: no task and queue in between, whole batches at once
        async for batch in streams[0].batches():
            for item in _coalesced([(0, output) for output in batch]):
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except BaseException as error:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        num_open = len(streams)
        while num_open:
            arrived = [await queue.get()]
            while not queue.empty():
                arrived.append(queue.get_nowait())
            for index, item in _coalesced(arrived):
                if isinstance(item, BaseException):
                    raise item
                num_open -= item.finished
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


_Arrival = tuple[int, StreamOutput | BaseException]  # (prompt index, its stream's output or error)


def _coalesced(arrived: list[_Arrival]) -> list[_Arrival]:
    """Runs of outputs for the same choice (prompt, sample) merged into one, order kept."""
    merged: list[_Arrival] = []
    for index, item in arrived:
        if merged and _continues(merged[-1], index, item):
            merged[-1] = (index, _joined(merged[-1][1], item))
        else:
            merged.append((index, item))
    return merged


def _continues(previous: _Arrival, index: int, item: StreamOutput | BaseException) -> bool:
    earlier = previous[1]
    return (previous[0] == index and isinstance(item, StreamOutput) and isinstance(earlier, StreamOutput)
            and earlier.index == item.index and earlier.finish_reason is None and not earlier.finished)


def _joined(earlier: StreamOutput, later: StreamOutput) -> StreamOutput:
    """Two consecutive outputs of one choice as one; the request-level fields are the later's."""
    logprobs = None if earlier.logprobs is None and later.logprobs is None else [
        *(earlier.logprobs or []), *(later.logprobs or [])]
    return replace(later, delta_text=earlier.delta_text + later.delta_text,
                   delta_token_ids=[*earlier.delta_token_ids, *later.delta_token_ids], logprobs=logprobs)


async def _next(merged: AsyncIterator[tuple[int, StreamOutput]]) -> tuple[int, StreamOutput]:
    try:
        return await anext(merged)
    except ValueError as error:
        raise invalid_parameter(error, _FIELDS) from error
    except Exception as error:
        raise engine_failure(error) or error


@dataclass(slots=True)
class _Logprobs:
    """OpenAI's legacy format: parallel lists of tokens, their log-probabilities, the alternatives
    and where each token starts in the choice's text."""

    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def as_dict(self) -> dict | None:
        if not self.tokens:
            return None
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


@dataclass(slots=True)
class _Reply:
    """How one request's outputs read in OpenAI's completion types."""

    id: str
    created: int
    model: str
    params: SamplingParams
    echo: bool
    prompts: list[str | list[int]]
    core: object
    include_usage: bool = False
    # per prompt: its usage once finished, else the tokens streamed so far (what the key is charged)
    tokens_used: dict[int, int] = field(default_factory=dict)
    final_usage: Usage | None = None  # every prompt's, once the last one finished
    chunk_prefix: str | None = None  # 'data: {"id":...,"choices":[' of every chunk (see _text_chunk)

    def num_tokens_used(self) -> int:
        return sum(self.tokens_used.values())

    def completion(self, outputs_per_prompt: list[list[StreamOutput]]) -> dict:
        choices, total = [], Usage(0, 0, 0)
        for prompt_index, outputs in enumerate(outputs_per_prompt):
            last = outputs[-1]
            for sample_index in range(self.params.n):
                mine = [output for output in outputs if output.index == sample_index]
                choices.append(self._whole_choice(prompt_index, sample_index, mine, last))
            total = _sum_usage(total, last.usage)
        self.final_usage = total
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(total), "system_fingerprint": None}

    def _whole_choice(self, prompt_index: int, sample_index: int, outputs: list[StreamOutput],
                      last: StreamOutput) -> dict:
        text = self._prompt_text(prompt_index) if self.echo else ""
        logprobs = _Logprobs()
        if self.echo and self.params.prompt_logprobs is not None:
            self._add_prompt_logprobs(prompt_index, logprobs, last.prompt_logprobs or [])
        logprobs.offset = len(text)
        finish_reason = None
        for output in outputs:
            self._add_logprobs(logprobs, output)
            text += output.delta_text
            finish_reason = output.finish_reason or finish_reason
        return self._choice(prompt_index, sample_index, text, logprobs, finish_reason)

    async def events(self, first: tuple[int, StreamOutput],
                     merged: AsyncIterator[tuple[int, StreamOutput]]) -> AsyncIterator[str]:
        """The SSE events: a chunk per output (the prompt first when echoing), the usage, ``[DONE]``."""
        offsets: dict[tuple[int, int], int] = {}
        total = Usage(0, 0, 0)
        try:
            item = first
            while item is not None:
                prompt_index, output = item
                key = (prompt_index, output.index)
                previous = offsets.get(key)  # characters of this choice sent so far
                text = self._prompt_text(prompt_index) if previous is None and self.echo else ""
                if self.params.logprobs is None:  # the hot path: no log-probability lists to build
                    text += output.delta_text
                    offsets[key] = (previous or 0) + len(text)
                    if text or output.finish_reason:
                        yield self._text_chunk(prompt_index * self.params.n + output.index, text,
                                               output.finish_reason)
                else:
                    logprobs = _Logprobs((previous or 0) + len(text))
                    self._add_logprobs(logprobs, output)
                    text += output.delta_text
                    offsets[key] = (previous or 0) + len(text)
                    if text or output.finish_reason or logprobs.tokens:
                        yield self._chunk([self._choice(prompt_index, output.index, text, logprobs,
                                                        output.finish_reason)])
                num_sent = self.tokens_used.get(prompt_index, 0)
                self.tokens_used[prompt_index] = num_sent + len(output.delta_token_ids)
                if output.finished:
                    total = _sum_usage(total, output.usage)
                    if output.usage is not None:
                        self.tokens_used[prompt_index] = output.usage.total_tokens
                item = await anext(merged, None)
            self.final_usage = total
            tail = event({**self._header(), "choices": [], "usage": usage(total)}) if self.include_usage else ""
        except Exception as error:  # headers are sent: the error travels as an event
            failure = engine_failure(error) or (invalid_parameter(error, _FIELDS) if isinstance(error, ValueError)
                                               else APIError(500, f"{type(error).__name__}: {error}"))
            tail = event(failure.body())
        yield tail + DONE  # one write

    def _add_logprobs(self, logprobs: _Logprobs, output: StreamOutput) -> None:
        for token_id, entries in zip(output.delta_token_ids, output.logprobs or []):
            logprobs.add(*self._token_logprob(token_id, entries))

    def _add_prompt_logprobs(self, prompt_index: int, logprobs: _Logprobs,
                             prompt_logprobs: list[dict[int, Logprob] | None]) -> None:
        for token_id, entries in zip(self._prompt_ids(prompt_index), prompt_logprobs):
            if entries is None:  # the first prompt token has no context
                logprobs.add(self.core.tokenizer.decode([token_id]), None, None)
            else:
                logprobs.add(*self._token_logprob(token_id, entries))

    def _token_logprob(self, token_id: int, entries: dict[int, Logprob]) -> tuple[str, float, dict[str, float]]:
        chosen = entries[token_id]
        top = {entry.decoded_token: entry.logprob for entry in sorted(entries.values(), key=lambda e: e.rank)
               if entry.rank <= self.params.logprobs or entry is chosen}
        return chosen.decoded_token or "", chosen.logprob, top

    def _prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        return prompt if isinstance(prompt, str) else self.core.tokenizer.decode(prompt)

    def _prompt_ids(self, prompt_index: int) -> list[int]:
        prompt = self.prompts[prompt_index]
        return prompt if not isinstance(prompt, str) else self.core.tokenizer.encode(prompt, add_special_tokens=True)

    def _choice(self, prompt_index: int, sample_index: int, text: str, logprobs: _Logprobs,
                finish_reason: str | None) -> dict:
        return {"index": prompt_index * self.params.n + sample_index, "text": text,
                "logprobs": logprobs.as_dict() if self.params.logprobs is not None else None,
                "finish_reason": finish_reason}

    def _header(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _text_chunk(self, index: int, text: str, finish_reason: str | None) -> str:
        """``_chunk`` of one choice without log-probabilities, the same characters, from a prefix made
        once per request: per token only the text is encoded (the streaming hot path)."""
        if self.chunk_prefix is None:
            header = event({**self._header(), "choices": [{"index": 0}]})
            self.chunk_prefix = header[:header.index('"choices":[') + len('"choices":[')]
        tail = ',"usage":null}\n\n' if self.include_usage else "}\n\n"
        finish = "null" if finish_reason is None else _json(finish_reason)
        return (f'{self.chunk_prefix}{{"index":{index},"text":{_json(text)},"logprobs":null,'
                f'"finish_reason":{finish}}}]{tail}')

    def _chunk(self, choices: list[dict]) -> str:
        chunk = {**self._header(), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return event(chunk)


# json.dumps(value, ensure_ascii=False) for a str, without building a JSONEncoder per call
_json = json.encoder.encode_basestring


def _sum_usage(total: Usage, more: Usage | None) -> Usage:
    if more is None:
        return total
    return Usage(total.prompt_tokens + more.prompt_tokens, total.completion_tokens + more.completion_tokens,
                 total.cached_tokens + more.cached_tokens)
