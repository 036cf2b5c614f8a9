"""Tool-call parsers: each format on outputs written the way its model family writes them, streaming
that rebuilds exactly what the whole-text parse returns, and garbled output that never raises."""
from __future__ import annotations

import json
import keyword
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hearth_llm.engine.tool_parsers import (TOOL_PARSERS, ContentDelta, InvalidToolCallDelta, ToolCallDelta,
                                            get_tool_parser, select_tool_parser)

# ---- outputs as the model families write them -----------------------------------------------------

QWEN25_TWO_CALLS = (
    "I'll check the current temperature and tomorrow's forecast for you.\n"
    "<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", "unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01", '
    '"unit": "celsius"}}\n'
    "</tool_call>"
)
HERMES_CODE_ARGUMENT = (
    "<tool_call>\n"
    '{"name": "run_python", "arguments": {"code": "for i in range(3):\\n    print(\\"h\\u00e9llo\\", i)", '
    '"timeout": 2.5, "env": {"LANG": "fr_FR.UTF-8", "DEBUG": null}, "args": [1, -20, 3e2, true, false], '
    '"note": "caf\u00e9 \U0001F600 \\ud83d\\ude00"}}\n'
    "</tool_call>"
)
LLAMA31_PYTHON_TAG = ('<|python_tag|>{"name": "get_current_conditions", "parameters": '
                      '{"location": "San Francisco, CA", "unit": "Fahrenheit"}}')
LLAMA31_TWO_CALLS = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                     '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}')
LLAMA32_TYPE_FIRST = '{"type": "function", "name": "search", "parameters": {"query": "llama 3.2 release date"}}'
MISTRAL_PRE_V11 = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}, '
    '{"name": "get_current_weather", "arguments": {"location": "London, UK", "format": "celsius"}}]'
)
MISTRAL_V11 = ('[TOOL_CALLS]get_current_weather{"location": "Paris, France", "format": "celsius"}'
               '[TOOL_CALLS]get_current_time{"timezone": "Europe/Paris"}')
MISTRAL_V13_ARGS = 'Let me look that up.[TOOL_CALLS]search[ARGS]{"query": "mistral small 3.1", "top_k": 3}'
PYTHONIC_TWO_CALLS = (
    "[get_weather(city='San Francisco', metric='celsius'), "
    "search_flights(route=['SFO', \"JFK\"], filters={'max_stops': 1, 'cabin': 'economy', "
    "'dates': ('2024-12-01', '2024-12-08'), 'nested': {'deep': [[-1, 2.5], []]}}, budget=-250.5, "
    "flexible=True, loyalty_id=None, note='it\\'s \"urgent\", ok')]"
)

# Malformed or unusual outputs: they must stream to the same result as they parse to.
HERMES_BAD_JSON = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
HERMES_NO_CLOSING_TAG = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
HERMES_DUPLICATE_KEY = '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>'
HERMES_STRING_ARGUMENTS = '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>'
HERMES_ARGUMENTS_FIRST = '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call> Done.'
HERMES_MISSING_BRACE = ('<tool_call>\n{"name": "f", "arguments": {"a": "</tool_call>"}\n</tool_call>\n'
                        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
LLAMA31_BUILTIN_TOOL = '<|python_tag|>brave_search.call(query="current weather in Menlo Park, California")'
PYTHONIC_INJECTION = "[f(a=__import__('os').system('touch /tmp/pwned'))]"

SAMPLES = {
    "hermes": [QWEN25_TWO_CALLS, HERMES_CODE_ARGUMENT, HERMES_BAD_JSON, HERMES_NO_CLOSING_TAG, HERMES_DUPLICATE_KEY,
               HERMES_STRING_ARGUMENTS, HERMES_ARGUMENTS_FIRST, HERMES_MISSING_BRACE,
               "The capital of France is Paris. <b>1 < 2</b>\n"],
    "llama3_json": [LLAMA31_PYTHON_TAG, LLAMA31_TWO_CALLS, LLAMA32_TYPE_FIRST, LLAMA31_BUILTIN_TOOL,
                    'Checking.<|python_tag|>{"name": "f", "arguments": {"x": [1]}}; then content', '{"answer": 42}'],
    "mistral": [MISTRAL_PRE_V11, MISTRAL_V11, MISTRAL_V13_ARGS, "[TOOL_CALLS]broken{", "Plain [answer] here."],
    "pythonic": [PYTHONIC_TWO_CALLS, PYTHONIC_INJECTION, "[f('positional'), g(x=1)] and some text",
                 "[1, 2, 3] are numbers", "[get_time()]"],
}
ALL_SAMPLES = [(name, text) for name, texts in SAMPLES.items() for text in texts]


def parse(parser_name: str, text: str):
    return get_tool_parser(parser_name)().parse(text)


# ---- hermes ---------------------------------------------------------------------------------------

def test_hermes_reads_qwen25_content_then_two_calls():
    parsed = parse("hermes", QWEN25_TWO_CALLS)
    assert parsed.content == "I'll check the current temperature and tomorrow's forecast for you."
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [
        ("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"}),
    ]
    assert parsed.invalid_tool_calls == []
    assert len({call.id for call in parsed.tool_calls}) == 2


def test_hermes_output_without_tags_is_all_content_unchanged():
    text = "  The capital of France is Paris.\n\n"
    assert parse("hermes", text).content == text


def test_hermes_accepts_a_call_whose_closing_tag_was_cut_off():
    parsed = parse("hermes", HERMES_NO_CLOSING_TAG)
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_hermes_tags_inside_argument_strings_are_text():
    text = '<tool_call>{"name": "note", "arguments": {"text": "wrap calls in <tool_call></tool_call>"}}</tool_call>'
    assert parse("hermes", text).tool_calls[0].arguments == {"text": "wrap calls in <tool_call></tool_call>"}


def test_hermes_a_new_tag_ends_a_call_left_unclosed():
    text = '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [call.name for call in parse("hermes", text).tool_calls] == ["a", "b"]


def test_hermes_malformed_json_becomes_an_invalid_call_with_the_raw_text():
    parsed = parse("hermes", HERMES_BAD_JSON)
    assert parsed.content == "Sure."
    assert parsed.tool_calls == []
    [invalid] = parsed.invalid_tool_calls
    assert invalid.name == "get_weather"
    assert invalid.raw_arguments.strip() == '{"name": "get_weather", "arguments": {"city": Paris}}'
    assert "invalid JSON" in invalid.error


def test_hermes_arguments_written_as_a_json_string_are_decoded():
    assert parse("hermes", HERMES_STRING_ARGUMENTS).tool_calls[0].arguments == {"a": [1, 2]}


def test_duplicate_argument_keys_make_the_call_invalid():
    parsed = parse("hermes", HERMES_DUPLICATE_KEY)
    assert parsed.tool_calls == [] and "duplicate" in parsed.invalid_tool_calls[0].error


def test_arguments_json_is_the_canonical_json_dumps():
    call = parse("hermes", HERMES_CODE_ARGUMENT).tool_calls[0]
    assert call.arguments["code"] == 'for i in range(3):\n    print("h\u00e9llo", i)'
    assert call.arguments_json == json.dumps(call.arguments)


# ---- llama3_json ----------------------------------------------------------------------------------

def test_llama31_call_after_python_tag():
    parsed = parse("llama3_json", LLAMA31_PYTHON_TAG)
    assert parsed.content == ""
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [
        ("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]


def test_llama31_calls_joined_by_semicolons():
    parsed = parse("llama3_json", LLAMA31_TWO_CALLS)
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]


def test_llama3_accepts_arguments_key_and_a_leading_type_key():
    assert parse("llama3_json", '{"name": "f", "arguments": {"x": 1}}').tool_calls[0].arguments == {"x": 1}
    assert parse("llama3_json", LLAMA32_TYPE_FIRST).tool_calls[0].name == "search"


def test_llama3_json_answer_that_is_not_a_call_stays_content():
    parsed = parse("llama3_json", '{"answer": 42}')
    assert parsed.content == '{"answer": 42}' and parsed.tool_calls == parsed.invalid_tool_calls == []


def test_llama31_builtin_tool_code_after_python_tag_is_an_invalid_call():
    parsed = parse("llama3_json", LLAMA31_BUILTIN_TOOL)
    assert parsed.tool_calls == []
    assert parsed.invalid_tool_calls[0].raw_arguments.startswith("brave_search.call(")


# ---- mistral --------------------------------------------------------------------------------------

def test_mistral_pre_v11_json_list():
    parsed = parse("mistral", MISTRAL_PRE_V11)
    assert [(call.name, call.arguments["location"]) for call in parsed.tool_calls] == [
        ("get_current_weather", "Paris, France"), ("get_current_weather", "London, UK")]


def test_mistral_v11_name_then_arguments_repeated():
    parsed = parse("mistral", MISTRAL_V11)
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [
        ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
        ("get_current_time", {"timezone": "Europe/Paris"})]


def test_mistral_v13_args_token_and_content_before_the_calls():
    parsed = parse("mistral", MISTRAL_V13_ARGS)
    assert parsed.content == "Let me look that up."
    assert parsed.tool_calls[0].arguments == {"query": "mistral small 3.1", "top_k": 3}


def test_mistral_call_ids_are_nine_alphanumeric_characters():
    ids = [call.id for call in parse("mistral", MISTRAL_PRE_V11).tool_calls + parse("mistral", MISTRAL_V11).tool_calls]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call_id) for call_id in ids)


# ---- pythonic -------------------------------------------------------------------------------------

def test_pythonic_literals_of_every_kind():
    parsed = parse("pythonic", PYTHONIC_TWO_CALLS)
    assert parsed.content == "" and parsed.invalid_tool_calls == []
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [
        ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
        ("search_flights", {
            "route": ["SFO", "JFK"],
            "filters": {"max_stops": 1, "cabin": "economy", "dates": ["2024-12-01", "2024-12-08"],
                        "nested": {"deep": [[-1, 2.5], []]}},
            "budget": -250.5, "flexible": True, "loyalty_id": None, "note": 'it\'s "urgent", ok'}),
    ]


@pytest.mark.parametrize("code", [
    "__import__('os').system('touch /tmp/pwned')", "open('/tmp/pwned', 'w')", "(lambda: 1)()", "f'{1+1}'",
    "[x for x in range(3)]", "1 + 1", "os.environ", "{1, 2}",
])
def test_pythonic_never_evaluates_code(code):
    parsed = parse("pythonic", f"[f(a={code})]")
    assert parsed.tool_calls == []
    assert parsed.invalid_tool_calls[0].name == "f" and "not a literal" in parsed.invalid_tool_calls[0].error


def test_pythonic_positional_arguments_make_an_invalid_call_and_text_after_the_list_is_content():
    parsed = parse("pythonic", "[f('positional'), g(x=1)] and some text")
    assert [call.name for call in parsed.tool_calls] == ["g"]
    assert "positional" in parsed.invalid_tool_calls[0].error
    assert parsed.content == "and some text"


def test_pythonic_output_that_is_not_a_call_list_is_content():
    assert parse("pythonic", "[1, 2, 3] are numbers").content == "[1, 2, 3] are numbers"


# ---- choosing a parser ----------------------------------------------------------------------------

def test_unknown_parser_name_raises_value_error_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"tool_parser must be one of \['gemma', 'granite', 'hermes', 'llama3_json', 'mistral', "
                                         r"'phi4_mini', 'pythonic', 'qwen3_coder'\]; got 'qwen'"):
        get_tool_parser("qwen")


@pytest.mark.parametrize("chat_template, model_type, expected", [
    ("{%- for tool_call in message.tool_calls %}{{- '<tool_call>\\n' }}", "qwen2", "hermes"),
    ("{{- '[TOOL_CALLS]' + message.tool_calls|tojson }}", None, "mistral"),
    ("{{- '<|python_tag|>' + tool_call.name + '.call(' }}", "llama", "llama3_json"),
    ("format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]",
     "llama", "pythonic"),
    (None, "mixtral", "mistral"),
    (None, "llama4", "pythonic"),
    ("{{ '<|im_start|>' + message['role'] }}", "llama", "hermes"),
    (None, None, "hermes"),
])
def test_select_tool_parser_reads_template_then_model_type(chat_template, model_type, expected):
    assert select_tool_parser(chat_template, model_type) == expected


# ---- streaming ------------------------------------------------------------------------------------

def stream(parser_name: str, pieces: list[str]) -> list:
    streamer = get_tool_parser(parser_name)().streamer()
    events = [event for piece in pieces for event in streamer.feed(piece)]
    return events + streamer.finish()


def rebuild(events: list) -> dict:
    """What a client holds after the stream: the shape ``summarize`` gives a ParsedOutput."""
    content, calls, invalid = "", {}, {}
    for event in events:
        if isinstance(event, ContentDelta):
            content += event.text
        elif isinstance(event, ToolCallDelta):
            assert event.index not in invalid
            if event.index not in calls:  # the first delta of a call names it
                assert event.id and event.name
                calls[event.index] = {"id": event.id, "name": event.name, "arguments": ""}
            else:
                assert event.id is None and event.name is None
            calls[event.index]["arguments"] += event.arguments_fragment
        else:
            assert isinstance(event, InvalidToolCallDelta) and event.index not in invalid
            invalid[event.index] = event.invalid_tool_call
    assert sorted(calls.keys() | invalid.keys()) == list(range(len(calls.keys() | invalid.keys())))
    valid = [calls[index] for index in sorted(calls) if index not in invalid]
    return {"content": content,
            "tool_calls": [(call["name"], call["arguments"]) for call in valid],
            "invalid_tool_calls": [(call.name, call.raw_arguments, call.error) for _, call in sorted(invalid.items())],
            "num_ids": len({call["id"] for call in valid} | {call.id for call in invalid.values()})}


def summarize(parsed) -> dict:
    return {"content": parsed.content,
            "tool_calls": [(call.name, call.arguments_json) for call in parsed.tool_calls],
            "invalid_tool_calls": [(call.name, call.raw_arguments, call.error) for call in parsed.invalid_tool_calls],
            "num_ids": len(parsed.tool_calls) + len(parsed.invalid_tool_calls)}


def assert_stream_rebuilds_parse(parser_name: str, pieces: list[str]) -> None:
    assert rebuild(stream(parser_name, pieces)) == summarize(parse(parser_name, "".join(pieces)))


@pytest.mark.parametrize("parser_name, text", ALL_SAMPLES)
def test_stream_split_at_every_position_rebuilds_the_parse(parser_name, text):
    for cut in range(len(text) + 1):
        assert_stream_rebuilds_parse(parser_name, [text[:cut], text[cut:]])


@pytest.mark.parametrize("parser_name, text", ALL_SAMPLES)
def test_stream_one_character_at_a_time_rebuilds_the_parse(parser_name, text):
    assert_stream_rebuilds_parse(parser_name, list(text))


@pytest.mark.parametrize("parser_name, text", ALL_SAMPLES)
def test_stream_in_random_chunks_rebuilds_the_parse(parser_name, text):
    rng = random.Random(f"{parser_name}:{text}")
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 12))))
        assert_stream_rebuilds_parse(parser_name, [text[start:end] for start, end in zip([0] + cuts, cuts + [None])])


def test_stream_holds_back_what_may_be_the_start_of_a_tag():
    streamer = get_tool_parser("hermes")().streamer()
    assert streamer.feed("Hello <tool") == [ContentDelta("Hello")]
    assert streamer.feed("kit") == [ContentDelta(" <toolkit")]


def test_stream_sends_arguments_only_as_far_as_they_are_settled():
    streamer = get_tool_parser("hermes")().streamer()
    [first] = streamer.feed('<tool_call>{"name": "f", "arguments": {"n": 12')
    assert (first.name, first.arguments_fragment) == ("f", '{"n": ')  # 12 may grow; nothing is auto-closed
    fragments = [event.arguments_fragment for event in streamer.feed("3, \"s\": \"ab") + streamer.feed('c"}}')]
    assert first.arguments_fragment + "".join(fragments) == '{"n": 123, "s": "abc"}'


def test_stream_ends_a_malformed_call_with_an_invalid_delta():
    events = stream("hermes", ['<tool_call>{"name": "f", "arguments": {"a": ', "oops}}</tool_call>"])
    assert isinstance(events[0], ToolCallDelta) and events[0].name == "f"
    assert isinstance(events[-1], InvalidToolCallDelta) and events[-1].index == 0


# ---- any arguments, any spacing ------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=10)
chunk_cuts = st.lists(st.floats(0, 1), max_size=8)


def chunked(text: str, cuts: list[float]) -> list[str]:
    positions = sorted(int(cut * len(text)) for cut in cuts)
    return [text[start:end] for start, end in zip([0] + positions, positions + [None])]


@settings(max_examples=150, deadline=None)
@given(arguments=st.dictionaries(st.text(max_size=6), json_values, max_size=4), ensure_ascii=st.booleans(),
       indent=st.sampled_from([None, 0, 2]), separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]),
       cuts=chunk_cuts)
def test_any_json_arguments_however_spaced_parse_and_stream_exactly(arguments, ensure_ascii, indent, separators, cuts):
    written = json.dumps(arguments, ensure_ascii=ensure_ascii, indent=indent, separators=separators)
    for parser_name, text in [("hermes", f'<tool_call>\n{{"name": "f", "arguments": {written}}}\n</tool_call>'),
                              ("llama3_json", f'<|python_tag|>{{"name": "f", "parameters": {written}}}'),
                              ("mistral", f"[TOOL_CALLS]f{written}")]:
        assert [call.arguments for call in parse(parser_name, text).tool_calls] == [arguments]
        assert_stream_rebuilds_parse(parser_name, chunked(text, cuts))


@settings(max_examples=150, deadline=None)
@given(arguments=st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True).filter(
           lambda name: not keyword.iskeyword(name)), json_values, max_size=4), cuts=chunk_cuts)
def test_any_python_literal_arguments_parse_and_stream_exactly(arguments, cuts):
    text = "[f(" + ", ".join(f"{name}={value!r}" for name, value in arguments.items()) + ")]"
    assert [call.arguments for call in parse("pythonic", text).tool_calls] == [arguments]
    assert_stream_rebuilds_parse("pythonic", chunked(text, cuts))


# ---- garbled output -------------------------------------------------------------------------------

SAMPLE_TEXTS = [text for _, text in ALL_SAMPLES]
MARKERS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
PIECES = MARKERS + ['{"name": "f", "arguments": ', '"parameters"', "{", "}", "[", "]", "(", ")", "f(a=", '"', "'",
                    "\\", "\\u00", ",", ";", ":", " ", "\n", "-1", "2.5e", "true", "nul", "None", "\u00e9",
                    "\U0001F600"]


@st.composite
def garbled_text(draw):
    return "".join(draw(st.lists(st.sampled_from(PIECES) | st.text(max_size=4), max_size=30)))


@st.composite
def truncated_sample(draw):
    text = draw(st.sampled_from(SAMPLE_TEXTS))
    return text[:draw(st.integers(0, len(text)))]


@st.composite
def sample_with_a_piece_inserted(draw):
    text = draw(st.sampled_from(SAMPLE_TEXTS))
    at = draw(st.integers(0, len(text)))
    return text[:at] + draw(st.sampled_from(PIECES)) + text[at:]


@settings(max_examples=300, deadline=None)
@given(text=garbled_text() | truncated_sample() | sample_with_a_piece_inserted(), cuts=chunk_cuts)
def test_garbled_output_never_raises_and_streams_to_the_same_result(text, cuts):
    for parser_name in TOOL_PARSERS:
        assert_stream_rebuilds_parse(parser_name, chunked(text, cuts))
