"""The chat service (engine/chat): requests planned without the engine, streams assembled from engine
outputs, and whole answers on the default model (SmolLM2-135M) compared with ``LLM.chat``."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import jsonschema
import pytest

from hearth_llm.engine import SamplingParams, get_engine
from hearth_llm.engine.chat import ChatPrompt, ChatRequest, ChatService, ChatStream, SamplingOptions
from hearth_llm.engine.chat.service import needs_model_info, plan_request
from hearth_llm.engine.model_info import ModelInfo
from hearth_llm.engine.outputs import Logprob, StreamOutput, Usage
from hearth_llm.engine.tool_calling import normalize_tool_choice, tool_parser_for
from hearth_llm.engine.tool_parsers import HermesToolParser, ToolCallDelta

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def model_info(chat_template: str | None = CHATML, model_type: str = "llama") -> ModelInfo:
    return ModelInfo(model="test", architecture="LlamaForCausalLM", model_type=model_type, max_model_len=2048,
                     vocab_size=100, chat_template=chat_template, eos_token_ids=frozenset({2}))


# ---- tool_choice and the tool-call format ---------------------------------------------------------

@pytest.mark.parametrize("tool_choice, normalized", [
    (None, "auto"), ("auto", "auto"), ("none", "none"), ("required", "required"), ("any", "required"),
    (True, "required"), (False, "auto"), ("get_time", "get_time"),
    ({"type": "function", "function": {"name": "get_time"}}, "get_time"), ({"name": "get_time"}, "get_time"),
])
def test_tool_choice_forms_normalize_to_openai_words_or_a_tool_name(tool_choice, normalized):
    assert normalize_tool_choice(tool_choice, [WEATHER, TIME]) == normalized


def test_a_tool_choice_naming_an_unknown_tool_names_the_tools():
    with pytest.raises(ValueError, match=r"tool_choice .*\['get_weather'\].*'get_time'"):
        normalize_tool_choice("get_time", [WEATHER])


@pytest.mark.parametrize("chat_template, model_type, tool_parser", [
    (CHATML, "llama", "hermes"),                                            # tools offered the hermes way
    ("{% if tools %}<tool_call>{{ tools }}{% endif %}", "qwen2", "hermes"),
    ("{% if tools %}<|python_tag|>{{ tools }}{% endif %}", "llama", "llama3_json"),
    ("{% if tools %}{{ tools }}{% endif %}", "mistral", "mistral"),         # the family decides
    (CHATML, "mistral", "hermes"),                                          # no tools in the template
    (None, "mistral", "hermes"),
])
def test_the_tool_call_format_follows_the_template_then_the_family(chat_template, model_type, tool_parser):
    assert tool_parser_for(chat_template, model_type) == tool_parser


# ---- planning a request (no engine) ---------------------------------------------------------------

def test_a_plain_request_becomes_a_chat_prompt_without_tools_or_parser():
    plan = plan_request(ChatRequest(QUESTION, sampling=SamplingOptions(temperature=0)), None)
    assert isinstance(plan.prompt, ChatPrompt) and plan.prompt.messages == QUESTION and plan.prompt.tools is None
    assert plan.tool_parser is None and plan.params.structured_output is None
    assert plan.params.temperature == 0 and plan.params.max_tokens is None  # until EOS, not SamplingParams' 16


def test_a_required_call_is_forced_by_a_grammar_in_the_models_format():
    request = ChatRequest(QUESTION, tools=[WEATHER], tool_choice="required")
    assert needs_model_info(request)
    plan = plan_request(request, model_info())
    assert isinstance(plan.tool_parser, HermesToolParser)
    assert plan.prompt.tools == [WEATHER]
    assert "<tool_call>" in plan.params.structured_output.grammar


def test_a_named_tool_choice_grammar_admits_only_that_tool():
    grammar = plan_request(ChatRequest(QUESTION, tools=[WEATHER, TIME], tool_choice="get_time",
                                       tool_parser="hermes"), None).params.structured_output.grammar
    assert "get_time" in grammar and "get_weather" not in grammar


def test_tool_choice_none_offers_no_tools_and_needs_no_model():
    request = ChatRequest(QUESTION, tools=[WEATHER], tool_choice="none")
    assert not needs_model_info(request)
    plan = plan_request(request, None)
    assert plan.prompt.tools is None and plan.tool_parser is None and plan.params.structured_output is None


def test_auto_reads_calls_but_constrains_nothing():
    plan = plan_request(ChatRequest(QUESTION, tools=[WEATHER]), model_info("{% if tools %}[TOOL_CALLS]{% endif %}"))
    assert plan.tool_parser.name == "mistral" and plan.params.structured_output is None


def test_a_forced_tool_choice_without_tools_is_rejected():
    with pytest.raises(ValueError, match="tool_choice='required' needs at least one tool"):
        plan_request(ChatRequest(QUESTION, tool_choice="required"), None)


def test_a_forced_tool_choice_cannot_be_combined_with_structured_output():
    request = ChatRequest(QUESTION, tools=[WEATHER], tool_choice="required", structured_output={"json_object": True})
    with pytest.raises(ValueError, match="structured_output cannot be combined"):
        plan_request(request, model_info())


def test_structured_output_alone_reaches_the_sampling_params():
    plan = plan_request(ChatRequest(QUESTION, structured_output={"choice": ["yes", "no"]}), None)
    assert plan.params.structured_output.choice == ("yes", "no")


def test_forcing_a_call_in_a_format_without_a_grammar_names_the_format():
    with pytest.raises(ValueError, match="pythonic"):
        plan_request(ChatRequest(QUESTION, tools=[WEATHER], tool_choice="required", tool_parser="pythonic"), None)


def test_a_preformatted_prompt_is_sent_as_is_and_takes_no_tools():
    assert plan_request(ChatRequest("The capital of France is"), None).prompt == "The capital of France is"
    with pytest.raises(ValueError, match="preformatted"):
        ChatRequest("The capital of France is", tools=[WEATHER])


def test_request_options_are_keyword_only_and_checked():
    with pytest.raises(TypeError):
        ChatRequest(QUESTION, [WEATHER])  # noqa: the tools must be named
    with pytest.raises(ValueError, match="tool_parser must be one of"):
        ChatRequest(QUESTION, tool_parser="json")
    with pytest.raises(ValueError, match="temperature"):
        plan_request(ChatRequest(QUESTION, sampling=SamplingOptions(temperature=-1)), None)


@pytest.mark.parametrize("options, logprobs", [
    ({}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 3}, 3), ({"top_logprobs": 2}, 2),
])
def test_logprobs_are_asked_the_openai_way(options, logprobs):
    assert SamplingOptions(**options).to_sampling_params().logprobs == logprobs


def test_sampling_options_leave_unset_fields_at_the_engines_defaults():
    params = SamplingOptions(top_k=5, stop=["\n"]).to_sampling_params()
    defaults = SamplingParams()
    assert (params.top_k, params.stop_strings) == (5, ("\n",))
    assert (params.temperature, params.top_p, params.repetition_penalty) == (
        defaults.temperature, defaults.top_p, defaults.repetition_penalty)


# ---- assembling a stream (engine outputs made by hand) --------------------------------------------

class ScriptedStream:
    """Stands in for a RequestStream: hands out prepared outputs; remembers being closed."""

    request_id = "scripted"

    def __init__(self, outputs: list[StreamOutput]):
        self.outputs, self.is_closed = outputs, False

    def __iter__(self):
        yield from self.outputs

    async def __aiter__(self):
        for output in self.outputs:
            yield output

    def close(self):
        self.is_closed = True


CALL_PIECES = ["Let me check.", "\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Par',
               'is"}}', "\n</tool_call>"]


def scripted(pieces: list[str], logprobs: bool = False) -> list[StreamOutput]:
    outputs = []
    for index, piece in enumerate(pieces):
        entries = [{10 + index: Logprob(-0.5, 1, piece), 99: Logprob(-1.5, 2, "x")}] if logprobs else None
        outputs.append(StreamOutput("scripted", piece, [10 + index], logprobs=entries))
    last = outputs[-1]
    last.finished, last.finish_reason, last.usage = True, "stop", Usage(20, len(pieces), 16)
    last.prompt = "<|im_start|>user\nWeather?<|im_end|>\n"
    return outputs


def test_deltas_hold_markup_out_of_the_content_and_stream_the_call():
    deltas = list(ChatStream(ScriptedStream(scripted(CALL_PIECES)), HermesToolParser(), None))
    assert len(deltas) == len(CALL_PIECES) and [d.text for d in deltas] == CALL_PIECES
    assert "".join(d.content for d in deltas) == "Let me check."
    events = [event for delta in deltas for event in delta.tool_calls]
    assert all(isinstance(event, ToolCallDelta) for event in events)
    assert events[0].name == "get_weather" and all(event.name is None for event in events[1:])
    assert "".join(event.arguments_fragment for event in events) == json.dumps({"city": "Paris"})
    assert [d.result is not None for d in deltas] == [False] * (len(CALL_PIECES) - 1) + [True]


def test_the_result_parses_the_whole_text_and_carries_usage_and_the_prompt():
    result = ChatStream(ScriptedStream(scripted(CALL_PIECES)), HermesToolParser(), None).collect()
    assert result.content == "Let me check." and result.text == "".join(CALL_PIECES)
    assert [(call.name, call.arguments) for call in result.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert result.invalid_tool_calls == [] and result.finish_reason == "stop"
    assert result.usage == Usage(20, len(CALL_PIECES), 16) and result.prompt.startswith("<|im_start|>user")
    assert result.logprobs is None


def test_a_malformed_call_is_an_invalid_tool_call():
    pieces = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris}}', "\n</tool_call>"]
    result = ChatStream(ScriptedStream(scripted(pieces)), HermesToolParser(), None).collect()
    assert result.tool_calls == [] and [bad.name for bad in result.invalid_tool_calls] == ["get_weather"]


def test_without_a_parser_the_text_is_the_content():
    pieces = ["The capital", " is <tool_call>", " Paris."]
    deltas = list(ChatStream(ScriptedStream(scripted(pieces)), None, None))
    assert [d.content for d in deltas] == pieces and deltas[-1].result.content == "".join(pieces)


def test_logprob_entries_are_in_openai_form_with_the_asked_number_of_alternatives():
    deltas = list(ChatStream(ScriptedStream(scripted(["Par", "is"], logprobs=True)), None, 1))
    first = deltas[0].logprobs[0]
    assert first == {"token": "Par", "bytes": list(b"Par"), "logprob": -0.5,
                     "top_logprobs": [{"token": "Par", "bytes": list(b"Par"), "logprob": -0.5}]}
    assert [entry["token"] for entry in deltas[-1].result.logprobs] == ["Par", "is"]


async def test_async_iteration_gives_the_same_deltas_and_result():
    sync = list(ChatStream(ScriptedStream(scripted(CALL_PIECES)), HermesToolParser(), None))
    deltas = [delta async for delta in ChatStream(ScriptedStream(scripted(CALL_PIECES)), HermesToolParser(), None)]
    assert [(d.text, d.content) for d in deltas] == [(d.text, d.content) for d in sync]
    strip_ids = [[dataclasses.replace(e, id=None) for e in d.tool_calls] for d in deltas]
    assert strip_ids == [[dataclasses.replace(e, id=None) for e in d.tool_calls] for d in sync]
    result = await ChatStream(ScriptedStream(scripted(CALL_PIECES)), HermesToolParser(), None).acollect()
    assert (result.content, result.tool_calls[0].arguments) == (sync[-1].result.content, {"city": "Paris"})


def test_leaving_the_loop_early_closes_the_engine_stream():
    source = ScriptedStream(scripted(CALL_PIECES))
    for _ in ChatStream(source, None, None):
        break
    assert source.is_closed


# ---- on the default model --------------------------------------------------------------------------

@pytest.fixture
def service(smollm2) -> ChatService:
    return ChatService(get_engine("default", dtype="float32"))  # the session's engine, shared with smollm2


def test_a_chat_answer_equals_llm_chat(service, smollm2):
    result = service.chat(ChatRequest(QUESTION, sampling=SamplingOptions(temperature=0, max_tokens=12)))
    expected = smollm2.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert result.content == result.text == expected.outputs[0].text
    assert result.prompt == expected.prompt and result.finish_reason == expected.outputs[0].finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_a_required_call_is_well_formed_and_streams_its_arguments(service):
    request = ChatRequest([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                          tool_choice="required", sampling=SamplingOptions(temperature=0, max_tokens=48))
    result = service.chat(request)
    assert result.content == "" and result.invalid_tool_calls == [] and result.finish_reason == "stop"
    [call] = result.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(call.arguments, WEATHER["function"]["parameters"])
    deltas = list(service.stream(request))
    fragments = [event.arguments_fragment for delta in deltas for event in delta.tool_calls]
    assert "".join(fragments) == call.arguments_json  # greedy: the same call, streamed
    assert all(delta.content == "" for delta in deltas)


def test_achat_and_astream_match_chat(service):
    request = ChatRequest(QUESTION, sampling=SamplingOptions(temperature=0, max_tokens=12))
    expected = service.chat(request).content

    async def run():
        whole = await service.achat(request)
        deltas = [delta async for delta in await service.astream(request)]
        return whole.content, "".join(delta.content for delta in deltas), deltas[-1].result.content

    assert asyncio.run(run()) == (expected, expected, expected)


def test_closing_a_stream_early_aborts_its_request(service):
    request = ChatRequest([{"role": "user", "content": "Write a long story about a dragon."}],
                          sampling=SamplingOptions(temperature=0, max_tokens=400))
    with service.stream(request) as stream:
        next(iter(stream))
    deadline = time.monotonic() + 10
    while service.core.stats()["num_running"] and time.monotonic() < deadline:  # aborted before the next step
        time.sleep(0.01)
    assert service.core.stats()["num_running"] == 0 and stream.result is None
    # the smollm2 fixture then checks that every KV block came back
