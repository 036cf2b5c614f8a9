"""HearthLLM: LlamaIndex chat, completion, RAG, agents and structured output on the default model."""
from __future__ import annotations

import time
import uuid

import pytest
from llama_index.core import Document, PromptTemplate, Settings, VectorStoreIndex
from llama_index.core.agent.workflow import FunctionAgent, ReActAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel

from hearth_llm.engine import get_engine
from hearth_llm.integrations.langchain import ChatHearth
from hearth_llm.integrations.llama_index import HearthLLM
from hearth_llm.integrations.llama_index.llm import to_chat_messages

try:  # the colleague's embedding model; llama-index's MockEmbedding if it is not there
    from hearth_llm.integrations.llama_index import HearthEmbedding
except ImportError:
    HearthEmbedding = None

QUESTION = [ChatMessage(role="user", content="What is the capital of France?")]
DOCUMENTS = [Document(text="Paris is the capital of France."),
             Document(text="Berlin is the capital of Germany."),
             Document(text="The Loire is the longest river in France.")]


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def llm() -> HearthLLM:
    return HearthLLM(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def embed_model():
    if HearthEmbedding is None:
        from llama_index.core import MockEmbedding
        return MockEmbedding(embed_dim=8)
    return HearthEmbedding()


@pytest.fixture(autouse=True)
def engine_is_idle_after(llm):
    """Every request of a test has finished or been aborted, and its KV blocks are free again."""
    yield
    core = llm.core
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = core.stats()
        if stats.get("num_running") == 0 and stats.get("num_waiting") == 0 and stats.get("num_queued") == 0:
            break
        time.sleep(0.01)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_queued"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.fixture
def global_settings():
    """Settings as they were before the test."""
    saved = Settings._llm, Settings._embed_model
    yield Settings
    Settings._llm, Settings._embed_model = saved


# ---- the LLM interface ------------------------------------------------------------------------

def test_metadata_reports_the_engines_context_window_and_function_calling(llm):
    metadata = llm.metadata
    assert metadata.context_window == llm.core.engine.max_model_len
    assert metadata.num_output == 64 and metadata.model_name == "default"
    assert metadata.is_chat_model and metadata.is_function_calling_model


def test_chat_answers_with_token_usage(llm):
    response = llm.chat(QUESTION)
    assert response.message.role == "assistant" and "Paris" in response.message.content
    usage = response.raw["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert response.raw["finish_reason"] == "stop" and response.additional_kwargs == usage


def test_stream_chat_deltas_add_up_to_the_chat_answer(llm):
    chunks = list(llm.stream_chat(QUESTION))
    assert len(chunks) > 1
    assert "".join(chunk.delta for chunk in chunks) == chunks[-1].message.content == llm.chat(QUESTION).message.content


def test_complete_renders_the_prompt_as_a_user_turn(llm):
    assert llm.complete("What is the capital of France?").text == llm.chat(QUESTION).message.content
    chunks = list(llm.stream_complete("What is the capital of France?"))
    assert chunks[-1].text == "".join(chunk.delta for chunk in chunks) == llm.chat(QUESTION).message.content


def test_formatted_complete_sends_the_prompt_raw(llm):
    response = llm.complete("The capital of France is", formatted=True, max_tokens=3)
    assert response.raw["usage"]["prompt_tokens"] < 10  # no chat template, no system prompt


async def test_async_methods_are_native_and_match_the_sync_ones(llm, monkeypatch):
    expected = llm.chat(QUESTION).message.content
    for name in ("chat", "stream_chat", "complete", "stream_complete"):
        monkeypatch.setattr(HearthLLM, name, lambda *args, **kwargs: pytest.fail("an async method called a sync one"))
    assert (await llm.achat(QUESTION)).message.content == expected
    assert [chunk async for chunk in await llm.astream_chat(QUESTION)][-1].message.content == expected
    assert (await llm.acomplete("What is the capital of France?")).text == expected
    assert [chunk async for chunk in await llm.astream_complete("What is the capital of France?")][-1].text == expected


def test_leaving_a_stream_early_aborts_its_request(llm):
    stream = llm.stream_chat([ChatMessage(role="user", content="Write a long story about a dragon.")],
                             max_tokens=500)
    next(stream)
    stream.close()  # engine_is_idle_after checks that the blocks came back


def test_per_call_options_override_fields_and_unknown_ones_are_rejected(llm):
    assert llm.chat(QUESTION, max_tokens=2).raw["usage"]["completion_tokens"] == 2
    with pytest.raises(TypeError, match="temprature"):
        llm.chat(QUESTION, temprature=0.5)


# ---- tools and structured output --------------------------------------------------------------

def test_tool_required_forces_a_valid_call(llm):
    tool = FunctionTool.from_defaults(multiply)
    response = llm.chat_with_tools([tool], user_msg="Hello there!", tool_required=True)
    [call] = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "multiply" and set(call.tool_kwargs) == {"a", "b"}
    assert all(isinstance(value, int) for value in call.tool_kwargs.values())


def test_streamed_tool_calls_arrive_whole_on_the_last_chunk_without_markup_in_deltas(llm):
    tool = FunctionTool.from_defaults(multiply)
    chunks = list(llm.stream_chat_with_tools([tool], user_msg="What is 6 times 7?", tool_required=True))
    assert all(chunk.delta == "" and not llm.get_tool_calls_from_response(chunk, error_on_no_tool_call=False)
               for chunk in chunks[:-1])
    [call] = llm.get_tool_calls_from_response(chunks[-1])
    assert (call.tool_name, call.tool_kwargs) == ("multiply", {"a": 6, "b": 7})


def test_a_forced_tool_choice_without_tools_is_rejected(llm):
    with pytest.raises(ValueError, match="tool_choice='required' needs at least one tool"):
        llm.chat(QUESTION, tool_choice="required")


def test_get_tool_calls_raises_on_a_plain_answer_unless_told_not_to(llm):
    response = llm.chat(QUESTION)
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(response)
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []


def test_tool_calls_and_results_in_history_reach_the_template():
    history = [ChatMessage(role="user", content="6 times 7?"),
               ChatMessage(role="assistant", blocks=[ToolCallBlock(tool_call_id="c1", tool_name="multiply",
                                                                   tool_kwargs={"a": 6, "b": 7})]),
               ChatMessage(role="tool", content="42", additional_kwargs={"tool_call_id": "c1"})]
    assert to_chat_messages(history)[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]


def test_structured_predict_returns_a_valid_pydantic_object(llm):
    prompt = PromptTemplate("Extract the city and its country from this text: {text}")
    city = llm.structured_predict(City, prompt, text="Paris is the capital of France.")
    assert isinstance(city, City) and city.name == "Paris"


async def test_astructured_predict_returns_a_valid_pydantic_object(llm):
    prompt = PromptTemplate("Extract the city and its country from this text: {text}")
    city = await llm.astructured_predict(City, prompt, text="Berlin is the capital of Germany.")
    assert isinstance(city, City) and city.name == "Berlin"


# ---- RAG and agents ---------------------------------------------------------------------------

def test_streaming_query_engine_streams_an_answer(llm, embed_model):
    index = VectorStoreIndex.from_documents(DOCUMENTS, embed_model=embed_model)
    response = index.as_query_engine(llm=llm, streaming=True, similarity_top_k=2).query(
        "What is the capital of France?")
    tokens = list(response.response_gen)
    assert len(tokens) > 1 and "Paris" in "".join(tokens)


async def test_streaming_query_engine_streams_an_answer_async(llm, embed_model):
    index = VectorStoreIndex.from_documents(DOCUMENTS, embed_model=embed_model)
    response = await index.as_query_engine(llm=llm, streaming=True, similarity_top_k=2).aquery(
        "What is the capital of Germany?")
    tokens = [token async for token in response.async_response_gen()]
    assert len(tokens) > 1 and "Berlin" in "".join(tokens)


def test_global_settings_serve_index_and_query_engine(llm, embed_model, global_settings):
    global_settings.llm, global_settings.embed_model = llm, embed_model
    engine = VectorStoreIndex.from_documents(DOCUMENTS).as_query_engine(similarity_top_k=2)
    assert engine._response_synthesizer._llm is llm
    assert "Paris" in str(engine.query("What is the capital of France?"))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside llama-index's workflows
async def test_function_agent_completes_a_tool_round_trip(llm):
    agent = FunctionAgent(tools=[multiply], llm=llm, initial_tool_choice="multiply",
                          system_prompt="You are a calculator. Answer with the tool's result.")
    handler = agent.run("What is 6 times 7?")
    results = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
    answer = await handler
    assert [(r.tool_name, r.tool_kwargs, r.tool_output.content) for r in results] == [
        ("multiply", {"a": 6, "b": 7}, "42")]
    assert "42" in str(answer)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside llama-index's workflows
async def test_react_agent_runs_to_an_answer(llm):
    answer = await ReActAgent(tools=[multiply], llm=llm).run("What is 6 times 7?")
    assert str(answer).strip()


# ---- one engine per model ---------------------------------------------------------------------

def test_chat_hearth_and_hearth_llm_share_one_engine_and_its_prefix_cache(llm):
    assert llm.core is get_engine("default")
    question = f"Please repeat this reference code back to me exactly: {uuid.uuid4().hex} {uuid.uuid4().hex}"
    num_prompt_tokens_before = llm.core.stats()["num_prompt_tokens"]
    first = ChatHearth(temperature=0, max_tokens=4).invoke(question)
    assert llm.core.stats()["num_prompt_tokens"] > num_prompt_tokens_before  # ChatHearth ran on llm.core
    second = llm.chat([ChatMessage(role="user", content=question)], max_tokens=4).raw["usage"]
    assert second["prompt_tokens"] == first.usage_metadata["input_tokens"]
    assert second["cached_tokens"] > first.usage_metadata["input_token_details"]["cache_read"]
    assert second["cached_tokens"] >= second["prompt_tokens"] - llm.core.config.block_size
