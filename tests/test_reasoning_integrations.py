"""Thinking through the integrations, on the bundled SmolLM2 made to think (a think-block budget
opens the block after the prompt): LangChain's ``reasoning_content`` and v1 ``reasoning`` blocks,
LlamaIndex's ``ThinkingBlock``; invoke and the merged stream agree, reasoning chunks come first."""
from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage, ThinkingBlock

from hearth_llm.integrations.langchain import ChatHearth
from hearth_llm.integrations.llama_index import HearthLLM

QUESTION = "What is the capital of France?"
THINKING = dict(reasoning_parser="think", max_reasoning_tokens=4, max_tokens=12, temperature=0,
                engine_kwargs={"dtype": "float32"})  # the engine of the session's default_llm


@pytest.fixture(scope="module")
def chat(default_llm) -> ChatHearth:
    return ChatHearth(**THINKING)


def test_langchain_invoke_puts_the_think_block_in_reasoning_content(chat):
    message = chat.invoke(QUESTION)
    reasoning = message.additional_kwargs["reasoning_content"]
    assert reasoning and message.content and reasoning not in message.content
    assert message.usage_metadata["output_token_details"] == {"reasoning": 4}
    assert [block["type"] for block in message.content_blocks] == ["reasoning", "text"]
    assert message.content_blocks[0]["reasoning"] == reasoning


def test_langchain_stream_sends_reasoning_first_and_merges_to_the_invoke_message(chat):
    message = chat.invoke(QUESTION)
    chunks = list(chat.stream(QUESTION))
    merged = sum(chunks[1:], chunks[0])
    assert merged.content == message.content
    assert merged.additional_kwargs["reasoning_content"] == message.additional_kwargs["reasoning_content"]
    kinds = ["reasoning" if c.additional_kwargs.get("reasoning_content") else "content" if c.content else None
             for c in chunks]
    kinds = [kind for kind in kinds if kind]
    assert kinds == sorted(kinds, key=lambda kind: kind != "reasoning") and kinds[0] == "reasoning"


def test_langchain_v1_output_has_a_reasoning_block_before_the_text(default_llm):
    message = ChatHearth(**THINKING, output_version="v1").invoke(QUESTION)
    assert [block["type"] for block in message.content] == ["reasoning", "text"]


def test_llama_index_chat_returns_a_thinking_block_and_streams_thinking_deltas(default_llm):
    llm = HearthLLM(**{**THINKING, "thinking": None})
    response = llm.chat([ChatMessage(role="user", content=QUESTION)])
    [thinking] = [block for block in response.message.blocks if isinstance(block, ThinkingBlock)]
    assert thinking.content and thinking.num_tokens == 4 and response.raw["usage"]["reasoning_tokens"] == 4
    assert response.message.content and thinking.content not in response.message.content
    chunks = list(llm.stream_chat([ChatMessage(role="user", content=QUESTION)]))
    assert "".join(c.additional_kwargs.get("thinking_delta", "") for c in chunks) == thinking.content
    assert "".join(c.delta for c in chunks) == response.message.content
