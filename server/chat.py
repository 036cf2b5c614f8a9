"""``POST /v1/chat/completions``: OpenAI's chat request mapped onto a :class:`ChatRequest`, and the
chat service's :class:`ChatResult` / :class:`ChatDelta` mapped back to OpenAI's response and chunks.

Nothing else happens here: the tool-call format, ``tool_choice`` and its grammar, sampling and
the chat template are the chat service's (``hearth_llm.engine.chat``), exactly as for ``ChatHearth``.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from hearth_llm.engine.chat import ChatDelta, ChatRequest, ChatResult, ChatStream, SamplingOptions
from hearth_llm.engine.outputs import Usage
from hearth_llm.engine.tool_parsers import InvalidToolCallDelta, ToolCallDelta

from .errors import APIError, engine_failure, invalid_parameter
from .ids import random_hex
from .protocol import ChatCompletionRequest
from .sse import DONE, EventStreamResponse, event
from .state import ServerState, off_the_loop

_FIELDS = frozenset(ChatCompletionRequest.model_fields) | {"structured_output", "sampling", "timeout"}


async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    """The endpoint: 200 with the answer (or its event stream), else an :class:`APIError`."""
    state: ServerState = request.app.state.hearth
    state.check_chat_model(body.model)
    reply = _Reply(id=f"chatcmpl-{random_hex()}", created=int(time.time()), model=state.settings.chat_model_name,
                   parallel_tool_calls=body.parallel_tool_calls is not False,
                   include_usage=bool(body.stream_options and body.stream_options.include_usage),
                   n=body.n or 1)
    chat_request = to_chat_request(body, state, reply.id, state.timeout(request))
    request.state.log.update(model=body.model, user=body.user or body.safety_identifier, engine_request_id=reply.id)
    await state.admit(request)
    stream = await _start(state, chat_request)

    def close() -> None:
        stream.close()
        state.charge(request, reply.num_tokens_used(), reply.final_usage)

    try:
        if body.stream:
            deltas = aiter(stream)
            first = await _first(deltas)  # a template that rejects the conversation is still a 400 here
            return EventStreamResponse(reply.events(first, deltas), on_close=close)
        results = await _collect(stream)
    except BaseException:
        close()
        raise
    state.charge(request, results[0].usage.total_tokens, results[0].usage)
    return JSONResponse(reply.completion(results))


def to_chat_request(body: ChatCompletionRequest, state: ServerState, request_id: str,
                    timeout: float | None) -> ChatRequest:
    """The chat service's request for ``body``; :class:`APIError` (400) naming the field it cannot serve."""
    n = state.check_n(body.n)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise APIError(400, "max_tokens and max_completion_tokens disagree; send one", param="max_completion_tokens")
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = state.max_tokens(getattr(body, field), field)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    tool_choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    _check_strict_tools(tools, tool_choice)
    sampling = SamplingOptions(
        n=n, temperature=body.temperature, max_tokens=max_tokens, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, stop=body.stop, logprobs=body.logprobs,
        top_logprobs=body.top_logprobs)
    try:
        return ChatRequest(chat_messages(body.messages), tools=tools or None,
                           tool_choice=tool_choice if tools else _choice_without_tools(tool_choice),
                           structured_output=_structured_output(body), sampling=sampling,
                           chat_template_kwargs=body.chat_template_kwargs, timeout=timeout,
                           priority=body.priority or 0, request_id=request_id)
    except (ValueError, TypeError) as error:
        raise invalid_parameter(error, _FIELDS) from error


def chat_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates read them: OpenAI's ``developer`` role is its newer name for ``system``."""
    return [{**message, "role": "system"} if message.get("role") == "developer" else message
            for message in messages]


def _choice_without_tools(tool_choice):
    if tool_choice in (None, "auto", "none"):
        return None
    raise APIError(400, f"tool_choice={tool_choice!r} needs at least one tool in tools", param="tool_choice")


def _check_strict_tools(tools: list[dict], tool_choice) -> None:
    """``strict`` promises schema-valid arguments, which only a forced call (decoded under the
    schema's grammar) keeps; with ``auto`` the model writes the call unconstrained."""
    if tool_choice in (None, "auto") and any(tool["function"].get("strict") for tool in tools):
        raise APIError(400, "tools: function.strict=true is guaranteed only with tool_choice 'required' or a named "
                            "function (the call is then decoded under its schema); with 'auto' it cannot be",
                       param="tools")


def _structured_output(body: ChatCompletionRequest) -> dict | None:
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json": {"type": "object"}}  # an object, as OpenAI's JSON mode promises (not any JSON value)
    schema = response_format.json_schema.schema_ if response_format.json_schema else None
    return {"json": schema if schema is not None else {"type": "object"}}


async def _start(state: ServerState, chat_request: ChatRequest) -> ChatStream:
    try:
        if state.adds_can_block:
            return await off_the_loop(lambda: state.chat_service.stream(chat_request), ChatStream.close)
        return await state.chat_service.astream(chat_request)
    except (ValueError, TypeError) as error:
        raise invalid_parameter(error, _FIELDS) from error
    except Exception as error:
        raise engine_failure(error) or error


async def _first(deltas: AsyncIterator[ChatDelta]) -> ChatDelta:
    try:
        return await anext(deltas)
    except ValueError as error:
        raise invalid_parameter(error, _FIELDS) from error
    except Exception as error:
        raise engine_failure(error) or error


async def _collect(stream: ChatStream) -> list[ChatResult]:
    try:
        await stream.acollect()
        return stream.results
    except ValueError as error:
        raise invalid_parameter(error, _FIELDS) from error
    except Exception as error:
        raise engine_failure(error) or error


@dataclass(slots=True)
class _Reply:
    """How one answer reads in OpenAI's types."""

    id: str
    created: int
    model: str
    parallel_tool_calls: bool
    include_usage: bool
    n: int = 1
    num_deltas: int = 0                 # engine outputs streamed, each at least one token
    final_usage: Usage | None = None    # the request's, once its last output was streamed

    def num_tokens_used(self) -> int:
        """The request's prompt + completion tokens once it finished streaming; before that (the
        client left, an error), the outputs it was sent, a lower bound of its completion tokens."""
        return self.final_usage.total_tokens if self.final_usage is not None else self.num_deltas

    def completion(self, results: list[ChatResult]) -> dict:
        """The whole response: one choice per answer, the request's usage."""
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [self._choice(index, result) for index, result in enumerate(results)],
                "usage": usage(results[0].usage), "system_fingerprint": None}

    def _choice(self, index: int, result: ChatResult) -> dict:
        tool_calls = _kept(result.tool_calls, self.parallel_tool_calls)
        content = result.content + "".join(call.raw_arguments or "" for call in result.invalid_tool_calls)
        message = {"role": "assistant", "content": content if content or not tool_calls else None}
        if tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments_json}}
                                     for call in tool_calls]
        return {"index": index, "message": message,
                "logprobs": None if result.logprobs is None else {"content": result.logprobs},
                "finish_reason": _finish_reason(result.finish_reason, bool(tool_calls))}

    async def events(self, first: ChatDelta, deltas: AsyncIterator[ChatDelta]) -> AsyncIterator[str]:
        """The SSE events: each answer's role, content and tool-call deltas and finish, the usage, ``[DONE]``."""
        for index in range(self.n):
            yield self._chunk(index, {"role": "assistant", "content": ""})
        has_tool_calls: set[int] = set()
        last_result = None
        try:
            delta = first
            while delta is not None:
                self.num_deltas += 1
                piece = self._delta(delta)
                if "tool_calls" in piece:
                    has_tool_calls.add(delta.index)
                if piece or delta.logprobs:
                    yield self._chunk(delta.index, piece, logprobs=delta.logprobs)
                if delta.result is not None:
                    last_result = delta.result
                    self.final_usage = delta.result.usage or self.final_usage
                    finish_reason = _finish_reason(delta.result.finish_reason, delta.index in has_tool_calls)
                    yield self._chunk(delta.index, {}, finish_reason=finish_reason)
                delta = await anext(deltas, None)
            tail = ""
            if self.include_usage and last_result is not None:
                tail = event({**self._header(), "choices": [], "usage": usage(last_result.usage)})
        except Exception as error:  # headers are sent: the error travels as an event, as OpenAI's does
            failure = engine_failure(error) or (invalid_parameter(error, _FIELDS) if isinstance(error, ValueError)
                                               else APIError(500, f"{type(error).__name__}: {error}"))
            tail = event(failure.body())
        yield tail + DONE  # one write

    def _delta(self, delta: ChatDelta) -> dict:
        piece: dict = {}
        content = delta.content
        calls = []
        for call in delta.tool_calls:
            if isinstance(call, InvalidToolCallDelta):  # fragments already sent cannot be taken back
                content += call.invalid_tool_call.raw_arguments or ""
            elif self.parallel_tool_calls or call.index == 0:
                calls.append(_tool_call_delta(call))
        if content:
            piece["content"] = content
        if calls:
            piece["tool_calls"] = calls
        return piece

    def _header(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _chunk(self, index: int, delta: dict, *, logprobs: list[dict] | None = None,
               finish_reason: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
                  "finish_reason": finish_reason}
        chunk = {**self._header(), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return event(chunk)


def _tool_call_delta(call: ToolCallDelta) -> dict:
    entry: dict = {"index": call.index, "function": {"arguments": call.arguments_fragment}}
    if call.id is not None:
        entry.update(id=call.id, type="function")
        entry["function"]["name"] = call.name
    return entry


def _kept(tool_calls: list, parallel_tool_calls: bool) -> list:
    return tool_calls if parallel_tool_calls else tool_calls[:1]


def _finish_reason(finish_reason: str | None, has_tool_calls: bool) -> str | None:
    if finish_reason == "stop" and has_tool_calls:
        return "tool_calls"
    return finish_reason


def usage(usage: Usage | None) -> dict | None:
    """OpenAI's usage object, cached prompt tokens included."""
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


