"""ChatHearth tool calling and structured output, on the default model (SmolLM2-135M).

The model never calls a tool on its own, so calls it "writes" in ``auto`` mode are pinned with a
regex (the ``structured_output`` call option): the engine then generates exactly that text, and the
tests check how ChatHearth reads it.
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import TypedDict

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.runnables import RunnableBinding
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from hearth_llm.integrations.langchain import ChatHearth
from hearth_llm.integrations.langchain.chat_models import _tool_parser_for

WEATHER_QUESTION = "What is the weather in Paris?"


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny in {city}"


@tool
def get_time(timezone: str) -> str:
    """Get the current time in a timezone."""
    return "12:00"


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(description="the city's name")
    country: str = Field(description="the country it is in")


class CityDict(TypedDict):
    name: str
    country: str


@pytest.fixture(scope="module")
def chat() -> ChatHearth:
    return ChatHearth(temperature=0, max_tokens=48, repetition_penalty=1.05, frequency_penalty=0.5)


def pinned(text: str) -> dict:
    """The ``structured_output`` option that makes the model write exactly ``text``."""
    return {"regex": re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text).replace("\n", "\\n")}


def merged(chunks) -> AIMessageChunk:
    full = None
    for chunk in chunks:
        full = chunk if full is None else full + chunk
    return full


# ---- bind_tools -----------------------------------------------------------------------------------

def test_bind_tools_binds_tools_in_openai_format():
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    bound = ChatHearth().bind_tools([get_weather, add, City, City.model_json_schema()])
    assert isinstance(bound, RunnableBinding)
    assert [t["function"]["name"] for t in bound.kwargs["tools"]] == ["get_weather", "add", "City", "City"]
    assert "tool_choice" not in bound.kwargs


@pytest.mark.parametrize("tool_choice, bound", [
    ("auto", "auto"), ("none", "none"), ("any", "any"), ("required", "any"), (True, "any"),
    ("get_time", "get_time"), ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
])
def test_tool_choice_forms_are_normalized(tool_choice, bound):
    assert ChatHearth().bind_tools([get_weather, get_time], tool_choice=tool_choice).kwargs["tool_choice"] == bound


def test_tool_choice_naming_an_unbound_tool_is_rejected():
    with pytest.raises(ValueError, match=r"tool_choice .*\['get_weather'\].*'get_time'"):
        ChatHearth().bind_tools([get_weather], tool_choice="get_time")


# ---- choosing the tool-call format ----------------------------------------------------------------

def fake_core(chat_template: str, model_type: str):
    return SimpleNamespace(tokenizer=SimpleNamespace(chat_template=chat_template),
                           engine=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type)))


@pytest.mark.parametrize("chat_template, model_type, tool_parser", [
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", "llama", "hermes"),       # SmolLM2
    ("{% if tools %}<tool_call>{{ tools }}{% endif %}", "qwen2", "hermes"),
    ("{% if tools %}<|python_tag|>{{ tools }}{% endif %}", "llama", "llama3_json"),
    ("{% if tools %}[TOOL_CALLS]{{ tools }}{% endif %}", "mistral", "mistral"),
    ("{% if tools %}{{ tools }}{% endif %}", "mistral", "mistral"),
    ("{{ messages }}", "mistral", "hermes"),  # no tools in the template: they are offered the hermes way
])
def test_tool_parser_follows_the_chat_template_then_the_model_family(chat_template, model_type, tool_parser):
    assert _tool_parser_for(fake_core(chat_template, model_type)) == tool_parser


def test_tool_parser_field_overrides_the_choice():
    # The engine can force a call only in the hermes and llama3_json formats: the error shows which was used.
    chat = ChatHearth(tool_parser="pythonic").bind_tools([get_weather], tool_choice="any")
    with pytest.raises(ValueError, match="pythonic"):
        chat.invoke(WEATHER_QUESTION)


def test_an_unknown_tool_parser_is_rejected_at_construction():
    with pytest.raises(ValueError, match="tool_parser must be one of"):
        ChatHearth(tool_parser="json")


# ---- calls the grammar forces ---------------------------------------------------------------------

def test_tool_choice_any_forces_a_call_with_an_id_and_schema_valid_args(chat):
    message = chat.bind_tools([get_weather], tool_choice="any").invoke(WEATHER_QUESTION)
    assert message.content == "" and message.invalid_tool_calls == []
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_") and call["type"] == "tool_call"
    assert list(call["args"]) == ["city"] and isinstance(call["args"]["city"], str)
    assert "Sunny" in get_weather.invoke(call).content  # the call runs the tool as is


@pytest.mark.parametrize("tool_choice", ["get_time", {"type": "function", "function": {"name": "get_time"}}])
def test_a_named_tool_choice_calls_that_tool(chat, tool_choice):
    message = chat.bind_tools([get_weather, get_time], tool_choice=tool_choice).invoke(WEATHER_QUESTION)
    assert [call["name"] for call in message.tool_calls] == ["get_time"]


def test_the_default_tool_choice_field_applies_when_bind_tools_names_none():
    chat = ChatHearth(temperature=0, max_tokens=48, tool_choice="any")
    assert len(chat.bind_tools([get_weather]).invoke("Hello!").tool_calls) == 1


def test_stream_sends_the_name_once_then_argument_fragments(chat):
    bound = chat.bind_tools([get_weather], tool_choice="any")
    chunks = list(bound.stream(WEATHER_QUESTION))
    pieces = [piece for chunk in chunks for piece in chunk.tool_call_chunks]
    first, rest = pieces[0], pieces[1:]
    assert first["name"] == "get_weather" and first["id"].startswith("call_") and first["index"] == 0
    assert rest and all(piece["name"] is None and piece["id"] is None and piece["args"] for piece in rest)
    invoked = bound.invoke(WEATHER_QUESTION)
    assert "".join(piece["args"] for piece in pieces) == json.dumps(invoked.tool_calls[0]["args"])
    full = merged(chunks)
    assert full.content == "" and full.chunk_position == "last"
    assert [(c["name"], c["args"], c["id"]) for c in full.tool_calls] == [("get_weather", invoked.tool_calls[0]["args"],
                                                                          first["id"])]


async def test_async_invoke_and_stream_return_the_same_call(chat):
    bound = chat.bind_tools([get_weather], tool_choice="any")
    invoked = await bound.ainvoke(WEATHER_QUESTION)
    streamed = merged([chunk async for chunk in bound.astream(WEATHER_QUESTION)])
    assert [c["args"] for c in streamed.tool_calls] == [c["args"] for c in invoked.tool_calls]
    assert len(invoked.tool_calls) == 1


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(chat):
    plain = chat.invoke(WEATHER_QUESTION, max_tokens=1)
    message = chat.bind_tools([get_weather], tool_choice="none").invoke(WEATHER_QUESTION, max_tokens=1)
    assert message.usage_metadata["input_tokens"] == plain.usage_metadata["input_tokens"]
    assert message.tool_calls == []


def test_a_call_cut_short_is_invalid_in_invoke_and_in_the_merged_stream(chat):
    bound = chat.bind_tools([get_weather], tool_choice="any")
    message = bound.invoke(WEATHER_QUESTION, max_tokens=12)
    assert message.tool_calls == [] and message.response_metadata["finish_reason"] == "length"
    [invalid] = message.invalid_tool_calls
    assert "invalid JSON" in invalid["error"] and invalid["args"].startswith('\n{"name"')
    streamed = merged(bound.stream(WEATHER_QUESTION, max_tokens=12))
    assert streamed.tool_calls == [] and len(streamed.invalid_tool_calls) == 1


# ---- calls the model writes on its own (pinned by regex) ------------------------------------------

CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_auto_reads_content_and_a_call_from_the_text(chat):
    message = chat.bind_tools([get_weather]).invoke(WEATHER_QUESTION, structured_output=pinned(CALL_TEXT))
    assert message.content == "Let me check."
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_auto_streams_content_then_the_call(chat):
    chunks = list(chat.bind_tools([get_weather]).stream(WEATHER_QUESTION, structured_output=pinned(CALL_TEXT)))
    assert "".join(chunk.content for chunk in chunks) == "Let me check."
    assert [(c["name"], c["args"]) for c in merged(chunks).tool_calls] == [("get_weather", {"city": "Paris"})]


def test_a_malformed_call_is_an_invalid_tool_call_in_invoke_and_in_the_merged_stream(chat):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris}}\n</tool_call>'
    bound = chat.bind_tools([get_weather])
    message = bound.invoke(WEATHER_QUESTION, structured_output=pinned(text))
    assert message.tool_calls == []
    [invalid] = message.invalid_tool_calls
    assert invalid["name"] == "get_weather" and invalid["error"].startswith("invalid JSON")
    streamed = merged(bound.stream(WEATHER_QUESTION, structured_output=pinned(text)))
    assert streamed.tool_calls == [] and [c["name"] for c in streamed.invalid_tool_calls] == ["get_weather"]


# ---- structured output ----------------------------------------------------------------------------

CITY_QUESTION = "Name a city in France."


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_a_pydantic_schema_returns_an_instance(chat, method):
    city = chat.with_structured_output(City, method=method).invoke(CITY_QUESTION)
    assert isinstance(city, City) and city.name


@pytest.mark.parametrize("schema", [CityDict, City.model_json_schema()], ids=["typeddict", "json_schema"])
def test_a_typeddict_or_json_schema_returns_a_dict(chat, schema):
    assert set(chat.with_structured_output(schema).invoke(CITY_QUESTION)) == {"name", "country"}


def test_json_mode_returns_a_json_object(chat):
    result = chat.with_structured_output(City.model_json_schema(), method="json_mode").invoke(
        "Name a city in France. Answer in JSON.")
    assert isinstance(result, dict)


def test_structured_output_streams_growing_dicts(chat):
    chunks = list(chat.with_structured_output(CityDict).stream(CITY_QUESTION))
    assert len(chunks) > 1 and all(isinstance(chunk, dict) for chunk in chunks)
    assert set(chunks[-1]) == {"name", "country"}


def test_include_raw_keeps_the_message_and_the_parsing_error(chat):
    ok = chat.with_structured_output(City, include_raw=True).invoke(CITY_QUESTION)
    assert isinstance(ok["raw"], AIMessage) and isinstance(ok["parsed"], City) and ok["parsing_error"] is None
    cut = ChatHearth(temperature=0, max_tokens=4).with_structured_output(City, include_raw=True).invoke(CITY_QUESTION)
    assert cut["raw"].content and cut["parsed"] is None and cut["parsing_error"] is not None


def test_function_calling_with_include_raw_shows_the_forced_call(chat):
    result = chat.with_structured_output(City, method="function_calling", include_raw=True).invoke(CITY_QUESTION)
    assert [call["name"] for call in result["raw"].tool_calls] == ["City"]
    assert result["parsed"] == City(**result["raw"].tool_calls[0]["args"])


def test_unknown_methods_and_arguments_are_rejected():
    with pytest.raises(ValueError, match="method must be one of"):
        ChatHearth().with_structured_output(City, method="xml")
    with pytest.raises(ValueError, match="unknown argument"):
        ChatHearth().with_structured_output(City, temperature=0)


def test_the_structured_output_call_option_constrains_the_text(chat):
    assert chat.invoke("Is Paris in France?", structured_output={"choice": ["yes", "no"]}).content in {"yes", "no"}


def test_a_forced_tool_choice_cannot_be_combined_with_structured_output(chat):
    bound = chat.bind_tools([get_weather], tool_choice="any")
    with pytest.raises(ValueError, match="structured_output"):
        bound.invoke(WEATHER_QUESTION, structured_output={"json_object": True})


def test_repetition_penalty_is_checked_like_any_sampling_parameter(chat):
    with pytest.raises(ValueError, match="repetition_penalty"):
        chat.invoke(WEATHER_QUESTION, repetition_penalty=0)
