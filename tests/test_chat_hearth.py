"""ChatHearth: LangChain chat on the in-process engine. The default model (SmolLM2) unless a test
needs many requests, which run on a tiny random model with a chat template."""
from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import threading
import time

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from transformers import AutoTokenizer

from hearth_llm.engine import ChatPrompt, RequestTimeoutError, get_engine
from hearth_llm.engine.registry import render_chat_prompt
from hearth_llm.integrations.langchain import ChatHearth
from hearth_llm.integrations.langchain.chat_models import to_chat_messages

from conftest import random_prompts, record_steps_at_abort

QUESTION = "What is the capital of France?"
LONG_ANSWER = "Write a long story about a dragon who learns to bake bread."


@pytest.fixture(scope="module")
def chat() -> ChatHearth:
    return ChatHearth(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def tiny_chat_model(tiny_model_dirs, tmp_path_factory) -> str:
    """The tiny llama with a chat template: each message's words, then a separator word."""
    path = tmp_path_factory.mktemp("tiny_chat") / "llama"
    shutil.copytree(tiny_model_dirs["llama"], path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} w9 {% endfor %}"
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_chat(model: str, engine_kwargs: dict | None = None, **fields) -> ChatHearth:
    return ChatHearth(**{"model": model, "temperature": 0, "max_tokens": 6, **fields},
                      engine_kwargs={"kv_cache_memory": "16MiB", **(engine_kwargs or {})})


def wait_until_idle(core, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    stats = core.stats()
    while time.monotonic() < deadline:
        stats = core.stats()
        if stats.get("num_running") == 0 and stats.get("num_waiting") == 0 and stats.get("num_queued") == 0:
            break
        time.sleep(0.01)
    return stats


class PeakRunning:
    """Polls the engine's counters from a thread and keeps the largest ``num_running`` seen."""

    def __init__(self, core):
        self.core, self.peak, self._stop = core, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll)

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.core.stats().get("num_running", 0))
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()


class TokenRecorder(BaseCallbackHandler):
    def __init__(self):
        self.tokens: list[str] = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)


def test_invoke_answers_with_usage_and_metadata(chat):
    message = chat.invoke(QUESTION)
    assert message.content == "The capital of France is Paris."
    usage = message.usage_metadata
    assert usage["output_tokens"] == 8 and usage["input_tokens"] > 20
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert message.response_metadata["model_name"] == "default"
    assert message.response_metadata["finish_reason"] == "stop"
    assert "logprobs" not in message.response_metadata


def test_a_repeated_prompt_reports_prefix_cache_reads(chat):
    system = SystemMessage("You are a careful assistant who answers in one short sentence. " * 4)
    chat.invoke([system, HumanMessage("Name a color.")], max_tokens=1)
    usage = chat.invoke([system, HumanMessage("Name a fruit.")], max_tokens=1).usage_metadata
    assert usage["input_token_details"]["cache_read"] >= 32
    assert usage["input_token_details"]["cache_read"] < usage["input_tokens"]


def test_stream_yields_incremental_chunks_with_usage_only_on_the_last(chat):
    chunks = list(chat.stream(QUESTION))
    assert len(chunks) >= 8
    assert "".join(chunk.content for chunk in chunks) == "The capital of France is Paris."
    assert [chunk.usage_metadata is not None for chunk in chunks].count(True) == 1
    assert chunks[-1].usage_metadata["output_tokens"] == 8
    assert chunks[-1].chunk_position == "last"
    assert chunks[-1].response_metadata["model_name"] == "default"
    assert all("model_name" not in chunk.response_metadata for chunk in chunks[:-1])


async def test_astream_yields_incremental_chunks(chat):
    chunks = [chunk async for chunk in chat.astream(QUESTION)]
    assert [chunk.content for chunk in chunks][:3] == ["The", " capital", " of"]
    assert chunks[-1].usage_metadata["output_tokens"] == 8


async def test_leaving_astream_after_three_chunks_frees_the_blocks(chat, monkeypatch):
    core = get_engine("default")
    steps_at_abort = record_steps_at_abort(core, monkeypatch)
    num_seen = 0
    async for _ in ChatHearth(temperature=0, max_tokens=500).astream(LONG_ANSWER):
        num_seen += 1
        if num_seen == 3:
            break
    stats = await asyncio.to_thread(wait_until_idle, core)
    assert len(steps_at_abort) == 1
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_steps"] - steps_at_abort[0] <= 2  # the step in flight, then the abort


def test_timeout_aborts_and_raises_timeout_error():
    with pytest.raises(TimeoutError) as raised:
        ChatHearth(temperature=0, max_tokens=500, timeout=0.3).invoke(LONG_ANSWER)
    assert isinstance(raised.value, RequestTimeoutError)
    stats = wait_until_idle(get_engine("default"))
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_per_call_stop_ends_before_the_stop_string(chat):
    message = chat.invoke(QUESTION, stop=["Paris"])
    assert message.content == "The capital of France is "
    assert message.response_metadata["finish_reason"] == "stop"
    assert message.response_metadata["stop_reason"] == "Paris"


def test_per_call_sampling_options_and_unknown_ones(chat):
    assert chat.invoke(QUESTION, max_tokens=2).usage_metadata["output_tokens"] == 2
    with pytest.raises(TypeError, match="max_token"):
        chat.invoke(QUESTION, max_token=2)
    with pytest.raises(ValueError, match="temperature"):
        chat.invoke(QUESTION, temperature=-1)


def test_logprobs_when_asked():
    message = ChatHearth(temperature=0, max_tokens=4, logprobs=True, top_logprobs=3).invoke(QUESTION)
    content = message.response_metadata["logprobs"]["content"]
    assert [entry["token"] for entry in content] == ["The", " capital", " of", " France"]
    for entry in content:
        values = [top["logprob"] for top in entry["top_logprobs"]]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry["logprob"] == values[0]  # greedy picks the top token


def test_callbacks_receive_each_token_on_invoke_and_stream(chat):
    recorder = TokenRecorder()
    message = chat.invoke(QUESTION, config={"callbacks": [recorder]})
    assert "".join(recorder.tokens) == message.content and len(recorder.tokens) >= 7
    recorder.tokens.clear()
    chunks = list(chat.stream(QUESTION, config={"callbacks": [recorder]}))
    assert recorder.tokens == [chunk.content for chunk in chunks]


def test_messages_render_through_the_chat_template_with_tool_calls_and_results(chat):
    history = [
        SystemMessage("You check the weather."),
        HumanMessage("Weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}]),
        ToolMessage("Sunny, 21 C", tool_call_id="call_1", name="get_weather"),
    ]
    messages = to_chat_messages(history)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[3]["tool_call_id"] == "call_1"
    text = render_chat_prompt(get_engine("default").tokenizer, ChatPrompt(messages))
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text  # hermes style: SmolLM2 knows no tools
    assert text.endswith("<|im_start|>assistant\n")
    assert chat.invoke(history).content
    with pytest.raises(ValueError, match="image"):
        to_chat_messages([HumanMessage([{"type": "image", "url": "https://example.com/cat.png"}])])


def test_chain_with_prompt_and_parser_invokes_batches_and_streams(chat):
    chain = ChatPromptTemplate.from_messages([("human", "What is the capital of {country}?")]) | chat | StrOutputParser()
    assert chain.invoke({"country": "France"}) == "The capital of France is Paris."
    answers = chain.batch([{"country": "France"}, {"country": "Italy"}])
    assert answers[0] == "The capital of France is Paris." and "Italy" in answers[1]

    async def pieces():
        return [piece async for piece in chain.astream({"country": "France"})]

    streamed = asyncio.run(pieces())
    assert len(streamed) >= 7 and "".join(streamed) == "The capital of France is Paris."


async def test_64_concurrent_ainvokes_equal_their_solo_runs(tiny_chat_model):
    chat = tiny_chat(tiny_chat_model)
    prompts = [" ".join(f"w{t}" for t in ids) for ids in random_prompts(64, [3, 8, 15, 30], seed=11)]
    solo = [(await chat.ainvoke(prompt)).content for prompt in prompts]
    together = await asyncio.gather(*(chat.ainvoke(prompt) for prompt in prompts))
    assert [message.content for message in together] == solo
    assert len(set(solo)) > 32  # the prompts really lead to different answers


def test_batch_and_abatch_run_all_inputs_in_the_same_steps(tiny_chat_model):
    chat = tiny_chat(tiny_chat_model, max_tokens=24, engine_kwargs={"seed": 1})
    core = get_engine(tiny_chat_model, kv_cache_memory="16MiB", seed=1)
    prompts = [" ".join(f"w{t}" for t in ids) for ids in random_prompts(12, [5, 9], seed=12)]
    with PeakRunning(core) as batch_peak:
        chat.batch(prompts)
    with PeakRunning(core) as abatch_peak:
        asyncio.run(chat.abatch(prompts))
    assert batch_peak.peak == abatch_peak.peak == 12


async def test_async_paths_never_use_a_thread_executor(chat):
    class NoThreads(concurrent.futures.ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            raise AssertionError("an async path handed work to a thread executor")

    asyncio.get_running_loop().set_default_executor(NoThreads())
    assert (await chat.ainvoke(QUESTION)).content == "The capital of France is Paris."
    assert len([chunk async for chunk in chat.astream(QUESTION)]) >= 8


def test_construction_loads_nothing_and_identifies_itself():
    started = time.perf_counter()
    chat = ChatHearth(model="/nowhere/model.gguf", temperature=0.2, max_tokens=7, stop=["\n"])
    assert time.perf_counter() - started < 0.05
    assert chat._llm_type == "hearth-chat"
    assert chat._identifying_params["model"] == "/nowhere/model.gguf"
    params = chat._get_ls_params()
    assert (params["ls_provider"], params["ls_model_name"], params["ls_temperature"], params["ls_max_tokens"],
            params["ls_stop"]) == ("hearth", "/nowhere/model.gguf", 0.2, 7, ["\n"])
    assert chat._get_ls_params(model="other")["ls_model_name"] == "other"
