"""Honest truncation: an answer cut by ``max_tokens`` says so (finish_reason "length") everywhere,
structured output or a forced tool call cut short raises instead of coming back auto-closed into
something the schema does not admit, and a prompt that does not fit names the limit."""
from __future__ import annotations

import pytest
from langchain_core.exceptions import OutputParserException
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel

from hearth_llm.engine import SamplingParams, get_engine
from hearth_llm.engine.chat import ChatRequest, ChatService, SamplingOptions
from hearth_llm.integrations.langchain import ChatHearth
from hearth_llm.integrations.llama_index import HearthLLM

ENGINE = {"dtype": "float32"}  # the engine of the session's default_llm
QUESTION = "Write an invoice for 3 apples and 2 pears."
INVOICE = {"title": "Invoice", "type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "items": {"type": "object", "required": ["name", "qty"],
                               "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}}}}}}


class Item(BaseModel):
    name: str
    qty: int


@pytest.fixture(scope="module")
def chat(default_llm) -> ChatHearth:
    return ChatHearth(temperature=0, engine_kwargs=ENGINE)


def test_finish_reason_length_reaches_every_interface(default_llm, chat):
    [output] = default_llm.generate(QUESTION, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert output.outputs[0].finish_reason == "length"
    assert chat.invoke(QUESTION, max_tokens=3).response_metadata["finish_reason"] == "length"
    assert list(chat.stream(QUESTION, max_tokens=3))[-1].response_metadata["finish_reason"] == "length"
    result = ChatService(get_engine("default", show_progress=False, **ENGINE)).chat(
        ChatRequest([{"role": "user", "content": QUESTION}], sampling=SamplingOptions(temperature=0, max_tokens=3)))
    assert result.is_truncated and result.finish_reason == "length"
    response = HearthLLM(temperature=0, max_tokens=3, engine_kwargs=ENGINE).chat([ChatMessage(content=QUESTION)])
    assert response.raw["finish_reason"] == "length"


@pytest.fixture(scope="module")
def cut(default_llm) -> ChatHearth:
    return ChatHearth(temperature=0, max_tokens=8, engine_kwargs=ENGINE)


def test_a_json_answer_cut_by_max_tokens_raises_in_invoke_stream_and_include_raw(cut):
    structured = cut.with_structured_output(INVOICE)
    with pytest.raises(OutputParserException, match=r"cut after 8 tokens by max_tokens.*finish_reason='length'"):
        structured.invoke(QUESTION)
    with pytest.raises(OutputParserException, match="max_tokens"):
        list(structured.stream(QUESTION))
    raw = cut.with_structured_output(INVOICE, include_raw=True).invoke(QUESTION)
    assert raw["parsed"] is None and "max_tokens" in str(raw["parsing_error"])
    assert raw["raw"].response_metadata["finish_reason"] == "length"


@pytest.mark.parametrize("schema, method", [(Item, "json_schema"), (INVOICE, "function_calling")])
def test_a_pydantic_or_forced_call_answer_cut_by_max_tokens_raises(cut, schema, method):
    with pytest.raises(OutputParserException, match=r"cut after 8 tokens by max_tokens"):
        cut.with_structured_output(schema, method=method).invoke(QUESTION)


def test_structured_output_that_completes_is_parsed_as_before(chat):
    parsed = chat.with_structured_output(Item).invoke("Name a fruit and a quantity.", max_tokens=40)
    assert isinstance(parsed, Item)


def test_llama_index_tool_call_cut_by_max_tokens_names_max_tokens(default_llm):
    llm = HearthLLM(temperature=0, engine_kwargs=ENGINE)

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    tool = FunctionTool.from_defaults(fn=add)
    response = llm.chat_with_tools([tool], user_msg="What is 2 + 3?", tool_required=True, max_tokens=6)
    with pytest.raises(ValueError, match=r"cut after 6 tokens by max_tokens"):
        llm.get_tool_calls_from_response(response)


def test_a_prompt_longer_than_the_context_names_max_model_len(chat):
    too_long = "word " * 9000
    with pytest.raises(ValueError, match=r"max_model_len=8192"):
        chat.invoke(too_long)
    with pytest.raises(ValueError, match=r"max_model_len=8192"):
        HearthLLM(engine_kwargs=ENGINE).complete(too_long)
