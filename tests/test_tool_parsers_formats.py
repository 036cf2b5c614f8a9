"""The tool-call formats of the newer families: Qwen3-Coder's XML, Granite's and Phi-4-mini's JSON
lists, Gemma's ```tool_code blocks (Mistral's ``[TOOL_CALLS]name[ARGS]{...}`` is in test_tool_parsers.py).
Each whole, and streamed at every split point, one character at a time and in random chunks: the stream rebuilds
exactly what the whole-text parse returns."""
from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hearth_llm.engine.tool_parsers import get_tool_parser, select_tool_parser

from test_tool_parsers import assert_stream_rebuilds_parse

QWEN3_CODER_TWO_CALLS = (
    "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=units>\n{\"temp\": \"celsius\"}\n</parameter>\n</function>\n"
    "</tool_call>\n<tool_call>\n<function=run_code>\n<parameter=code>\nfor i in range(3):\n    print(i)\n"
    "</parameter>\n</function>\n</tool_call>")
QWEN3_CODER_NO_WRAPPER = "<function=get_time>\n<parameter=timezone>\nEurope/Paris\n</parameter>\n</function>"
QWEN3_CODER_CUT = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
QWEN3_CODER_DUPLICATE = "<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>"
GRANITE_TWO_CALLS = ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                     '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]')
PHI4_MINI_CALL = 'Sure. functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}]'
GEMMA_TWO_CALLS = ("I'll look both up.\n```tool_code\nget_weather(city='San Francisco', days=3, hourly=false)\n"
                   "get_time(timezone=\"Europe/Paris\", formats=['iso', \"unix\"])\n```")
GEMMA_LIST_AND_BLOCKS = ("```tool_code\n[search(query='a ```fence``` in a string'), count(n=-2)]\n```\nThen:\n"
                         "```tool_code\nplot(points=[(1, 2),\n        (3, 4)], style={'color': 'red'})\n```\nDone.")
GEMMA_CUT = "```tool_code\nget_time(timezone='UTC')\nget_weather(city='Par"
GEMMA_NOT_LITERAL = "```tool_code\nf(a=__import__('os').system('x'))\ng('positional')\n```"
GEMMA_OTHER_FENCE = "Run this:\n```python\nprint(get_time(timezone='UTC'))\n```"
GRANITE_CLOSED = '<|tool_call|>[{"name": "f", "parameters": {"x": 1}}]<|/tool_call|> Done.'

SAMPLES = {
    "qwen3_coder": [QWEN3_CODER_TWO_CALLS, QWEN3_CODER_NO_WRAPPER, QWEN3_CODER_CUT, QWEN3_CODER_DUPLICATE,
                    "<tool_call>\nnot a function\n</tool_call> and text", "Plain <b>answer</b>."],
    "granite": [GRANITE_TWO_CALLS, GRANITE_CLOSED, "<|tool_call|>oops", "No call here."],
    "phi4_mini": [PHI4_MINI_CALL, 'functools[{"name": "f", "arguments": {"a": "b"', "functools are nice"],
    "gemma": [GEMMA_TWO_CALLS, GEMMA_LIST_AND_BLOCKS, GEMMA_CUT, GEMMA_NOT_LITERAL, GEMMA_OTHER_FENCE,
              "```tool_code\n[1, 2]\n``` after", "```tool_code\nf(x=1)``"],
}
ALL_SAMPLES = [(name, text) for name, texts in SAMPLES.items() for text in texts]


def parse(parser_name: str, text: str):
    return get_tool_parser(parser_name)().parse(text)


def test_qwen3_coder_reads_content_then_calls_with_typed_values():
    parsed = parse("qwen3_coder", QWEN3_CODER_TWO_CALLS)
    assert parsed.content == "I'll check both." and not parsed.invalid_tool_calls
    weather, code = parsed.tool_calls
    assert (weather.name, weather.arguments) == ("get_weather", {"city": "San Francisco, CA", "days": 3,
                                                                 "units": {"temp": "celsius"}})
    assert (code.name, code.arguments) == ("run_code", {"code": "for i in range(3):\n    print(i)"})


def test_qwen3_coder_call_without_its_wrapper_tag_counts():
    [call] = parse("qwen3_coder", QWEN3_CODER_NO_WRAPPER).tool_calls
    assert (call.name, call.arguments) == ("get_time", {"timezone": "Europe/Paris"})


def test_qwen3_coder_call_cut_before_its_end_is_invalid():
    parsed = parse("qwen3_coder", QWEN3_CODER_CUT)
    [invalid] = parsed.invalid_tool_calls
    assert parsed.tool_calls == [] and invalid.name == "get_weather" and "</function>" in invalid.error


def test_qwen3_coder_duplicate_parameter_is_invalid():
    [invalid] = parse("qwen3_coder", QWEN3_CODER_DUPLICATE).invalid_tool_calls
    assert "duplicate parameter 'a'" in invalid.error


def test_granite_and_phi4_mini_read_their_json_lists():
    assert [(c.name, c.arguments) for c in parse("granite", GRANITE_TWO_CALLS).tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]
    closed = parse("granite", GRANITE_CLOSED)
    assert [(c.name, c.arguments) for c in closed.tool_calls] == [("f", {"x": 1})] and closed.content == "Done."
    phi = parse("phi4_mini", PHI4_MINI_CALL)
    assert phi.content == "Sure." and phi.tool_calls[0].arguments == {"city": "Paris", "days": [1, 2]}
    assert parse("granite", "<|tool_call|>oops").invalid_tool_calls


def test_gemma_reads_content_then_the_calls_of_a_tool_code_block():
    parsed = parse("gemma", GEMMA_TWO_CALLS)
    assert parsed.content == "I'll look both up." and not parsed.invalid_tool_calls
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "San Francisco", "days": 3, "hourly": False}),
        ("get_time", {"timezone": "Europe/Paris", "formats": ["iso", "unix"]})]


def test_gemma_reads_a_call_list_several_blocks_and_fences_inside_strings():
    parsed = parse("gemma", GEMMA_LIST_AND_BLOCKS)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("search", {"query": "a ```fence``` in a string"}), ("count", {"n": -2}),
        ("plot", {"points": [[1, 2], [3, 4]], "style": {"color": "red"}})]
    assert parsed.content == "Then:Done." and not parsed.invalid_tool_calls


def test_gemma_block_cut_short_keeps_whole_calls_and_flags_the_cut_one():
    parsed = parse("gemma", GEMMA_CUT)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_time", {"timezone": "UTC"})]
    [cut] = parsed.invalid_tool_calls
    assert cut.name == "get_weather" and "without its closing ```" in cut.error


def test_gemma_refuses_what_is_not_a_literal_keyword_call_and_leaves_other_fences_alone():
    parsed = parse("gemma", GEMMA_NOT_LITERAL)
    assert parsed.tool_calls == [] and [c.name for c in parsed.invalid_tool_calls] == ["f", "g"]
    assert "not a literal" in parsed.invalid_tool_calls[0].error and "positional" in parsed.invalid_tool_calls[1].error
    other = parse("gemma", GEMMA_OTHER_FENCE)
    assert other.content == GEMMA_OTHER_FENCE and other.tool_calls == [] == other.invalid_tool_calls


def test_gemma_stream_holds_back_a_possible_fence_and_streams_settled_arguments():
    stream = get_tool_parser("gemma")().streamer()
    assert [e.text for e in stream.feed("Sure. ```tool_co")] == ["Sure."]
    [first] = stream.feed("de\nget_time(timezone='UTC', ")
    assert (first.index, first.name, first.arguments_fragment) == (0, "get_time", '{"timezone": "UTC"')
    [rest] = stream.feed("day=1)\n```")
    assert (rest.name, rest.arguments_fragment) == (None, ', "day": 1}') and stream.finish() == []


@pytest.mark.parametrize("chat_template, expected", [
    ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}", "qwen3_coder"),
    ("{{- '<|tool_call|>' + message.tool_calls | tojson }}", "granite"),
    ("<|tool|>{{ tools | tojson }}<|/tool|>", "phi4_mini"),
    ("{{- '```tool_code\\n' + tool_call.name + '(' }}...{{- '```tool_output\\n' + message.content }}", "gemma"),
    ("Call functions as [func_name1(params_name1=params_value1)] in ```tool_code fences", "gemma"),
])
def test_the_format_is_read_from_the_chat_template(chat_template, expected):
    assert select_tool_parser(chat_template, None) == expected


@pytest.mark.parametrize("parser_name, text", ALL_SAMPLES)
def test_a_stream_cut_anywhere_rebuilds_the_parse(parser_name, text):
    for cut in range(len(text) + 1):
        assert_stream_rebuilds_parse(parser_name, [text[:cut], text[cut:]])
    assert_stream_rebuilds_parse(parser_name, list(text))
    rng = random.Random(f"{parser_name}:{text}")
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 12))))
        assert_stream_rebuilds_parse(parser_name, [text[start:end] for start, end in zip([0] + cuts, cuts + [None])])


# ---- garbled output, in the pieces these formats are made of ---------------------------------------

FORMAT_TEXTS = [text for _, text in ALL_SAMPLES]
FORMAT_PIECES = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">",
                 "<|tool_call|>", "<|/tool_call|>", "functools", "```tool_code", "```", "\n```", "`", "(", ")", "=",
                 "'", "f(a=", '{"name": "f", "arguments": ', "{", "}", "[", "]",
                 '"', "\\", ",", " ", "\n", "3", "true", "x"]


@st.composite
def garbled_format_text(draw):
    pieces = draw(st.lists(st.sampled_from(FORMAT_PIECES) | st.text(max_size=3), max_size=24))
    if draw(st.booleans()):  # or a real output with a piece inserted
        text = draw(st.sampled_from(FORMAT_TEXTS))
        at = draw(st.integers(0, len(text)))
        return text[:at] + "".join(pieces[:2]) + text[at:]
    return "".join(pieces)


@settings(max_examples=150, deadline=None)
@given(text=garbled_format_text(), cuts=st.lists(st.integers(0, 200), max_size=6))
def test_garbled_output_never_raises_and_streams_to_the_same_result(text, cuts):
    bounds = sorted({cut % (len(text) + 1) for cut in cuts})
    pieces = [text[start:end] for start, end in zip([0] + bounds, bounds + [len(text)])]
    for parser_name in SAMPLES:
        assert_stream_rebuilds_parse(parser_name, pieces)


# ---- forcing a call: the grammar admits exactly calls the parser reads back -----------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}


@pytest.mark.parametrize("parser_name, call_text", [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, France\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"),
    ("granite",
     '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris, France", "days": 3, "unit": "c"}}]'),
    ("phi4_mini", 'functools[{"name": "get_weather", "arguments": {"city": "Paris, France", "days": 3, "unit": "c"}}]'),
    ("gemma", '```tool_code\nget_weather(city="Paris, France", days=3, unit="c")\n```'),
])
def test_a_forced_call_grammar_admits_the_formats_call_and_it_parses_back(parser_name, call_text):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from hearth_llm.engine.tool_calling import tool_choice_constraint

    grammar = xgr.Grammar.from_ebnf(tool_choice_constraint([WEATHER], "required", parser_name).grammar)
    assert accepts(grammar, call_text)
    [call] = parse(parser_name, call_text).tool_calls
    assert (call.name, call.arguments) == ("get_weather", {"city": "Paris, France", "days": 3, "unit": "c"})
    if parser_name == "qwen3_coder":
        without_days = call_text.replace("<parameter=days>\n3\n</parameter>\n", "")
        assert not accepts(grammar, without_days)                                  # required parameter
        assert accepts(grammar, call_text.replace("<parameter=unit>\nc\n</parameter>\n", ""))   # optional one
        assert not accepts(grammar, call_text.replace("\n3\n", "\nthree\n"))        # an integer's schema
        assert not accepts(grammar, call_text.replace(">\nc\n<", ">\nk\n<"))       # an enum's values
    if parser_name == "gemma":
        assert not accepts(grammar, call_text.replace("days=3, ", ""))              # required argument
        assert accepts(grammar, call_text.replace(', unit="c"', ""))                 # optional one
        assert not accepts(grammar, call_text.replace("days=3", 'days="3"'))        # an integer's schema
        assert not accepts(grammar, call_text.replace('unit="c"', 'unit="k"'))      # an enum's values


def test_gemma_forced_call_grammar_with_only_optional_arguments_and_bad_names():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from hearth_llm.engine.tool_calling import tool_choice_constraint

    tool = {"name": "find", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "array", "items": {"type": "string"}}}}}
    grammar = xgr.Grammar.from_ebnf(tool_choice_constraint([tool], {"name": "find"}, "gemma").grammar)
    for arguments in ["", "a=1", "b=true", 'c=["x"]', "a=1, c=[]", 'a=-2, b=false, c=["y", "z"]']:
        text = f"```tool_code\nfind({arguments})\n```"
        assert accepts(grammar, text), text
        [call] = parse("gemma", text).tool_calls
        assert call.name == "find" and set(call.arguments) == set(re.findall(r"(\w+)=", arguments))
    for wrong in ["b=true, a=1", ", a=1", "a=1,", "a=1 b=true"]:
        assert not accepts(grammar, f"```tool_code\nfind({wrong})\n```"), wrong
    with pytest.raises(ValueError, match="tools: 'get-weather'"):
        tool_choice_constraint([{"name": "get-weather", "parameters": {}}], "required", "gemma")
    with pytest.raises(ValueError, match="tools: 'class'"):
        tool_choice_constraint([{"name": "f", "parameters": {"type": "object", "properties": {"class": {}}}}],
                               "required", "gemma")
