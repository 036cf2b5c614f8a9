"""Tools in the prompt and tool_choice enforced by grammar, on the default model."""
import json

import jsonschema
import pytest

from hearth_llm.engine import SamplingParams
from hearth_llm.engine.tool_calling import render_chat_with_tools, tool_choice_constraint
from hearth_llm.engine.tool_parsers import get_tool_parser

MAGIC = {"name": "magic_function", "description": "Applies a magic function to an input.",
         "parameters": {"type": "object", "properties": {"input": {"type": "integer"}}, "required": ["input"]}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
QUESTION = [{"role": "user", "content": "What is the value of magic_function(3)? Use the tool."}]


def call_model(llm, messages, tools, tool_choice, parser="hermes"):
    prompt = render_chat_with_tools(llm.tokenizer, messages, tools)
    constraint = tool_choice_constraint(tools, tool_choice, parser)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=80, structured_output=constraint),
                       use_tqdm=False)[0].outputs[0]
    return get_tool_parser(parser)().parse(out.text)


def test_required_tool_choice_yields_a_schema_valid_call(smollm2):
    parsed = call_model(smollm2, QUESTION, [MAGIC, WEATHER], "required")
    assert len(parsed.tool_calls) == 1 and not parsed.invalid_tool_calls
    call = parsed.tool_calls[0]
    schema = {"magic_function": MAGIC["parameters"], "get_weather": WEATHER["function"]["parameters"]}[call.name]
    jsonschema.validate(call.arguments, schema)
    assert call.name == "magic_function" and call.arguments == {"input": 3}


def test_named_tool_choice_forces_that_tool(smollm2):
    parsed = call_model(smollm2, [{"role": "user", "content": "Weather in Paris?"}], [MAGIC, WEATHER],
                        {"type": "function", "function": {"name": "get_weather"}})
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    jsonschema.validate(parsed.tool_calls[0].arguments, WEATHER["function"]["parameters"])


def test_llama3_json_format_constraint(smollm2):
    parsed = call_model(smollm2, QUESTION, [MAGIC], "required", parser="llama3_json")
    assert parsed.tool_calls and parsed.tool_calls[0].name == "magic_function"


def test_tools_reach_a_tool_unaware_template_as_a_hermes_system_prompt(smollm2):
    prompt = render_chat_with_tools(smollm2.tokenizer, QUESTION, [MAGIC])
    assert "<tools>" in prompt and '"name": "magic_function"' in prompt
    assert prompt.startswith("<|im_start|>system\n")


def test_tool_calls_and_results_in_history_are_rendered(smollm2):
    history = QUESTION + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a1", "type": "function", "function": {"name": "magic_function", "arguments": '{"input": 3}'}}]},
        {"role": "tool", "tool_call_id": "a1", "content": "5"},
    ]
    prompt = render_chat_with_tools(smollm2.tokenizer, history, [MAGIC])
    assert '<tool_call>\n{"name": "magic_function", "arguments": {"input": 3}}\n</tool_call>' in prompt
    assert "<tool_response>\n5\n</tool_response>" in prompt
    answer = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert "5" in answer.outputs[0].text


def test_auto_and_none_add_no_constraint():
    assert tool_choice_constraint([MAGIC], "auto") is None
    assert tool_choice_constraint([MAGIC], "none") is None


@pytest.mark.parametrize("tools, choice, match", [
    ([MAGIC], "nonexistent_tool", "not among the tools"), ([], "required", "at least one tool"),
    ([{"description": "no name"}], "required", "tools"), ([MAGIC], "required", "tool_parser"),
])
def test_bad_tool_arguments_name_the_parameter(tools, choice, match):
    parser = "pythonic" if match == "tool_parser" else "hermes"
    with pytest.raises(ValueError, match=match):
        tool_choice_constraint(tools, choice, parser)
