"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shape): the token ids the engine would read
for a prompt or a conversation, rendered and tokenized exactly as the engine does it."""
from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from hearth_llm.engine.chat import ChatPrompt, render_chat_prompt

from .chat import chat_messages
from .errors import APIError, invalid_parameter
from .protocol import DetokenizeRequest, TokenizeRequest
from .state import ServerState

_FIELDS = frozenset(TokenizeRequest.model_fields) | frozenset(DetokenizeRequest.model_fields)


async def tokenize(body: TokenizeRequest, request: Request):
    state = _checked(body.model, request)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", param="prompt")
    await asyncio.to_thread(state.core.wait_until_started)
    try:
        token_ids = await asyncio.to_thread(_token_ids, state, body)
    except (ValueError, TypeError) as error:
        raise invalid_parameter(error, _FIELDS) from error
    return JSONResponse({"count": len(token_ids), "max_model_len": state.core.model_info.max_model_len,
                         "tokens": token_ids})


async def detokenize(body: DetokenizeRequest, request: Request):
    state = _checked(body.model, request)
    await asyncio.to_thread(state.core.wait_until_started)
    vocab_size = state.core.model_info.vocab_size
    bad = [token for token in body.tokens if not 0 <= token < vocab_size]
    if bad:
        raise APIError(400, f"tokens must be in [0, {vocab_size}), got {bad[:5]}", param="tokens")
    text = await asyncio.to_thread(state.core.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})


def _checked(model: str | None, request: Request) -> ServerState:
    state: ServerState = request.app.state.hearth
    if model is not None:
        state.check_chat_model(model)
    return state


def _token_ids(state: ServerState, body: TokenizeRequest) -> list[int]:
    tokenizer = state.core.tokenizer
    text = body.prompt
    if body.messages is not None:
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
        prompt = ChatPrompt(chat_messages(body.messages), body.add_generation_prompt, body.chat_template_kwargs, tools)
        text = render_chat_prompt(tokenizer, prompt)
    if not text:
        raise ValueError("prompt must not be empty")
    return tokenizer.encode(text, add_special_tokens=True)  # as engine/input_processor.py tokenizes
