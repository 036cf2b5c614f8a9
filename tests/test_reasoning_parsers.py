"""Reasoning parsers (engine/reasoning) and the chat stream's split of thinking, answer and tool
calls: whole outputs, and streams cut at every split point, which must reconstruct the same split."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hearth_llm.engine.chat import ChatStream
from hearth_llm.engine.outputs import StreamOutput, Usage
from hearth_llm.engine.reasoning import (MistralReasoningParser, ThinkReasoningParser, get_reasoning_parser,
                                         prompt_opens_block, select_reasoning_parser, template_opens_block,
                                         thinking_switch)
from hearth_llm.engine.tool_parsers import HermesToolParser, ToolCallDelta

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
R1_TEMPLATE = ("{% for m in messages %}<｜{{ m.role }}｜>{{ m.content }}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
QUESTION = [{"role": "user", "content": "2 + 2?"}]

CASES = [  # (parser, output, reasoning, content)
    (ThinkReasoningParser(), "<think>\nTwo and two.\n</think>\n\nIt is 4.", "Two and two.", "It is 4."),
    (ThinkReasoningParser(), "It is 4.", "", "It is 4."),                                  # thinking off
    (ThinkReasoningParser(), "  <thinking> is a word", "", "  <thinking> is a word"),     # not the tag
    (ThinkReasoningParser(), "<think>Cut sho", "Cut sho", ""),                            # never closed
    (ThinkReasoningParser(), "<think></think>4", "", "4"),                                # empty block
    (ThinkReasoningParser(), "<think>a < b </thin", "a < b </thin", ""),
    (ThinkReasoningParser(starts_in_reasoning=True), "Two and two.</think>\n4", "Two and two.", "4"),
    (ThinkReasoningParser(starts_in_reasoning=True), "<think>Again.</think>4", "Again.", "4"),
    (ThinkReasoningParser(starts_in_reasoning=True), "Still thinking", "Still thinking", ""),
    (ThinkReasoningParser(), "<think>x</think>A </think> stays", "x", "A </think> stays"),
    (MistralReasoningParser(), "[THINK]Hm.[/THINK]Yes.", "Hm.", "Yes."),
]


@pytest.mark.parametrize("parser, output, reasoning, content", CASES)
def test_a_whole_output_splits_into_reasoning_and_content(parser, output, reasoning, content):
    parsed = parser.parse(output)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)


def streamed(parser, pieces: list[str]) -> tuple[list[str], list[str]]:
    stream = parser.streamer()
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return [r for r, _ in deltas], [c for _, c in deltas]


@pytest.mark.parametrize("parser, output, reasoning, content", CASES)
def test_a_stream_cut_at_any_point_splits_exactly_like_the_whole(parser, output, reasoning, content):
    for cut in range(len(output) + 1):
        reasonings, contents = streamed(parser, [output[:cut], output[cut:]])
        assert ("".join(reasonings), "".join(contents)) == (reasoning, content), cut
    reasonings, contents = streamed(parser, list(output))  # one character at a time
    assert ("".join(reasonings), "".join(contents)) == (reasoning, content)
    first_content = next((i for i, c in enumerate(contents) if c), len(contents))
    assert not any(reasonings[first_content + 1:]), "reasoning after the answer began"


def test_text_that_may_still_become_a_tag_is_held_back():
    stream = ThinkReasoningParser().streamer()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>Hm. </thi") == ("Hm.", "")
    assert not stream.is_reasoning_done
    assert stream.feed("nk>Yes") == ("", "Yes") and stream.is_reasoning_done


@pytest.mark.parametrize("chat_template, expected", [
    (QWEN3_TEMPLATE, "think"), (R1_TEMPLATE, "think"), ("[SYSTEM_PROMPT]…[THINK]", "mistral"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None), (None, None),
])
def test_the_reasoning_format_is_read_from_the_chat_template(chat_template, expected):
    assert select_reasoning_parser(chat_template) == expected


def test_the_thinking_switch_is_read_from_the_template():
    assert thinking_switch(QWEN3_TEMPLATE) == "enable_thinking"
    assert thinking_switch("{%- if thinking %}Think first.{% endif %}") == "thinking"
    assert thinking_switch(R1_TEMPLATE) is None


def test_a_template_that_opens_the_think_block_is_recognized():
    assert template_opens_block(R1_TEMPLATE, QUESTION, None, "<think>", "</think>")
    assert not template_opens_block(QWEN3_TEMPLATE, QUESTION, None, "<think>", "</think>")
    assert not template_opens_block(QWEN3_TEMPLATE, QUESTION, {"enable_thinking": False}, "<think>", "</think>")
    assert prompt_opens_block("…<|im_start|>assistant\n<think>\n", "<think>", "</think>")


def test_an_unknown_reasoning_parser_names_the_known_ones():
    with pytest.raises(ValueError, match=r"reasoning_parser must be one of \['deepseek_r1', 'mistral'"):
        get_reasoning_parser("o1")


# ---- the chat stream: thinking, then content and tool calls --------------------------------------

THINK_AND_CALL = ('<think>\nA <tool_call> here is only a thought.\n</think>\n\nChecking.\n'
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


class ListStream:
    """Engine outputs from a list, as a RequestStream hands them out."""

    def __init__(self, pieces: list[str]):
        self.request_id = "r"
        self._outputs = [StreamOutput("r", piece, [index]) for index, piece in enumerate(pieces)]
        self._outputs.append(StreamOutput("r", "", [len(pieces)], finish_reason="stop", finished=True,
                                          usage=Usage(prompt_tokens=3, completion_tokens=len(pieces) + 1)))

    def __iter__(self):
        return iter(self._outputs)

    def close(self):
        pass


def chat_stream(pieces: list[str]) -> ChatStream:
    return ChatStream(ListStream(pieces), HermesToolParser(), None, ThinkReasoningParser())


def test_a_whole_answer_keeps_thinking_out_of_content_and_tool_calls():
    result = chat_stream([THINK_AND_CALL]).collect()
    assert result.reasoning == "A <tool_call> here is only a thought."
    assert result.content == "Checking."
    [call] = result.tool_calls
    assert (call.name, call.arguments) == ("get_weather", {"city": "Paris"}) and not result.invalid_tool_calls
    assert result.text == THINK_AND_CALL


def test_a_streamed_answer_cut_at_every_point_matches_the_whole():
    whole = chat_stream([THINK_AND_CALL]).collect()
    for cut in range(len(THINK_AND_CALL) + 1):
        deltas = list(chat_stream([THINK_AND_CALL[:cut], THINK_AND_CALL[cut:]]))
        result = deltas[-1].result
        assert "".join(d.reasoning for d in deltas) == whole.reasoning == result.reasoning, cut
        assert "".join(d.content for d in deltas) == whole.content == result.content, cut
        fragments = [event for d in deltas for event in d.tool_calls]
        assert all(isinstance(event, ToolCallDelta) for event in fragments), cut
        assert json.loads("".join(event.arguments_fragment for event in fragments)) == {"city": "Paris"}, cut
        assert [event.name for event in fragments if event.name] == ["get_weather"], cut


def test_reasoning_tokens_count_the_think_block():
    pieces = ["<think>", "Two", " and two", ".</think>", "\n\n", "4"]
    result = ChatStream(ListStream(pieces), None, None, ThinkReasoningParser()).collect()
    assert (result.reasoning, result.content) == ("Two and two.", "4")
    assert result.usage.reasoning_tokens == 4 and result.usage.completion_tokens == 7
    plain = ChatStream(ListStream(["It", " is", " 4"]), None, None, ThinkReasoningParser()).collect()
    assert plain.usage.reasoning_tokens == 0 and plain.content == "It is 4"


# ---- garbled output: thinking, answer and calls still split the same, streamed or whole ------------

PIECES = ["<think>", "</think>", "<thi", "</th", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": ',
          "1}}", "\n", " ", "x", "<", ">", "/"]


@st.composite
def garbled(draw):
    return "".join(draw(st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=20)))


@settings(max_examples=150, deadline=None)
@given(text=garbled(), cuts=st.lists(st.integers(0, 200), max_size=6), opened=st.booleans())
def test_garbled_output_splits_the_same_streamed_or_whole(text, cuts, opened):
    bounds = sorted({cut % (len(text) + 1) for cut in cuts})
    pieces = [text[start:end] for start, end in zip([0] + bounds, bounds + [len(text)])]
    parser = ThinkReasoningParser(starts_in_reasoning=opened)
    whole = ChatStream(ListStream([text]), HermesToolParser(), None, parser).collect()
    deltas = list(ChatStream(ListStream(pieces), HermesToolParser(), None, parser))
    assert "".join(d.reasoning for d in deltas) == whole.reasoning
    assert "".join(d.content for d in deltas) == whole.content
    assert len({e.index for d in deltas for e in d.tool_calls}) == len(whole.tool_calls) + len(whole.invalid_tool_calls)
