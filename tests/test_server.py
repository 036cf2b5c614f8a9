"""The OpenAI-compatible server (hearth_llm.server) on 127.0.0.1, driven by real clients: the official
``openai`` client, LangChain's ``ChatOpenAI``, LlamaIndex's ``OpenAILike`` and raw HTTP. Greedy answers
must equal ``LLM.chat`` / ``ChatHearth`` on the same engine; every error has its status and OpenAI's
body; a client that leaves frees its KV blocks."""
from __future__ import annotations

import asyncio
import base64
import json
import threading
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from hearth_llm.embeddings import get_embedding_engine
from hearth_llm.engine import SamplingParams, get_engine
from hearth_llm.server import start_server

KEY = "sk-test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
               "required": ["name", "country"], "additionalProperties": False}
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # a raw prompt the model continues for as long as it may
MAX_BODY_BYTES = 64 * 1024
ENGINE = {"dtype": "float32"}  # the session's default_llm engine (tests/conftest.py)


@pytest.fixture(scope="module")
def server():
    running = start_server("default", api_key=KEY, max_body_bytes=MAX_BODY_BYTES, max_tokens_limit=4000, **ENGINE)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def core(server):
    return get_engine("default", **ENGINE)


@pytest.fixture(autouse=True)
def pool_whole_after(request):
    """Every test ends with the server's KV pool whole: nothing running, waiting or holding blocks.

    Polled, not read once: the engine's counters are as of its last step, and a client can read a
    request's last event before the step that produced it has updated them."""
    yield
    if "server" in request.fixturenames:
        wait_for_idle(get_engine("default", **ENGINE))


def wait_for_idle(core, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = core.stats()
        if (stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0
                and stats["num_waiting"] == 0 and stats["num_queued"] == 0):
            return stats
        assert time.monotonic() < deadline, f"the pool did not come back: {stats}"
        time.sleep(0.02)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.root_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as session:
        yield session


def expected_chat(llm, messages=QUESTION, max_tokens=16):
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]


# ---- answers equal the in-process ones ----------------------------------------------------------------

def test_openai_sync_chat_equals_llm_chat_token_for_token(client, default_llm):
    expected = expected_chat(default_llm)
    response = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=16,
                                              logprobs=True, top_logprobs=2)
    choice = response.choices[0]
    assert choice.message.content == expected.outputs[0].text and choice.finish_reason == "stop"
    tokens = [entry.token for entry in choice.logprobs.content]
    assert tokens == [default_llm.tokenizer.decode([t]) for t in expected.outputs[0].token_ids]
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.model == "SmolLM2-135M-Instruct" and response.id.startswith("chatcmpl-")


def test_openai_streaming_and_async_equal_the_whole_answer(server, client, default_llm):
    expected = expected_chat(default_llm).outputs[0].text
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0,
                                                 max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]  # usage once, last

    async def run():
        async_client = openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0)
        whole = await async_client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                                           max_tokens=16)
        stream = await async_client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                                            max_tokens=16, stream=True)
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream]
        return whole.choices[0].message.content, "".join(pieces)

    assert asyncio.run(run()) == (expected, expected)


def test_n_answers_come_from_one_request_whole_or_streamed(client, default_llm):
    expected = expected_chat(default_llm)
    response = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=16, n=2)
    assert [(c.index, c.message.content) for c in response.choices] == [(0, expected.outputs[0].text),
                                                                        (1, expected.outputs[0].text)]
    assert response.usage.completion_tokens == 2 * len(expected.outputs[0].token_ids)
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=16,
                                                n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert texts == {0: expected.outputs[0].text, 1: expected.outputs[0].text} and finishes == {0: "stop", 1: "stop"}
    sampled = [[c.message.content for c in client.chat.completions.create(
        model="default", messages=QUESTION, temperature=1.0, max_tokens=4, n=2, seed=7).choices] for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 2  # seeded: the same answers again


def test_a_forced_tool_call_equals_chat_hearths_and_streams_the_same_arguments(client):
    from hearth_llm.integrations.langchain import ChatHearth

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = client.chat.completions.create(model="default", messages=ask, tools=[WEATHER], tool_choice="required",
                                              temperature=0, max_tokens=48)
    choice = response.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    expected = ChatHearth(temperature=0, max_tokens=48, engine_kwargs=ENGINE).bind_tools(
        [WEATHER], tool_choice="any").invoke("What is the weather in Paris?").tool_calls[0]
    assert call.function.name == expected["name"] == "get_weather"
    assert json.loads(call.function.arguments) == expected["args"]
    chunks = list(client.chat.completions.create(model="default", messages=ask, tools=[WEATHER],
                                                 tool_choice="required", temperature=0, max_tokens=48, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_text(client, default_llm):
    response = client.chat.completions.create(model="default", messages=QUESTION, tools=[WEATHER], tool_choice="none",
                                              temperature=0, max_tokens=16)
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content == expected_chat(default_llm).outputs[0].text  # tools not even offered


def test_a_json_schema_answer_follows_the_schema(client):
    response = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Name a city in France."}], temperature=0,
        max_tokens=40, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), CITY_SCHEMA)


def test_embeddings_as_floats_and_base64_equal_the_engines(client, http):
    texts = ["The cat sat on the mat.", "Paris is in France."]
    expected = get_embedding_engine().embed(texts).numpy()
    response = client.embeddings.create(model="default", input=texts)  # the client asks for base64
    assert np.allclose(np.array([item.embedding for item in response.data]), expected, atol=1e-6)
    assert response.usage.prompt_tokens > len(texts) and response.model == "all-MiniLM-L6-v2"
    floats = http.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": texts[0],
                                               "encoding_format": "float"}).json()
    assert np.allclose(floats["data"][0]["embedding"], expected[0], atol=1e-6)
    raw = http.post("/v1/embeddings", json={"model": "default", "input": texts, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][1]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, expected[1].astype("<f4"))
    for body, param in (({"input": [[101, 102]]}, "input"), ({"input": []}, "input"),
                        ({"input": "x", "dimensions": 128}, "dimensions")):
        assert error_of(http.post("/v1/embeddings", json={"model": "default", **body}), 400)["param"] == param


def test_langchain_chat_openai_equals_chat_hearth(server):
    from langchain_openai import ChatOpenAI

    from hearth_llm.integrations.langchain import ChatHearth

    remote = ChatOpenAI(base_url=server.url, api_key=KEY, model="default", temperature=0, max_tokens=16,
                        max_retries=0)
    local = ChatHearth(temperature=0, max_tokens=16, engine_kwargs=ENGINE)
    expected = local.invoke(QUESTION)
    message = remote.invoke(QUESTION)
    assert message.content == expected.content
    assert message.usage_metadata["output_tokens"] == expected.usage_metadata["output_tokens"]
    assert "".join(chunk.content for chunk in remote.stream(QUESTION)) == expected.content
    # a named tool_choice, as ChatOpenAI sends it: {"type": "function", "function": {"name": ...}}
    [call] = remote.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?", max_tokens=48).tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


def test_llama_index_openai_like_answers(server, default_llm):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model="default", api_base=server.url, api_key=KEY, is_chat_model=True, temperature=0,
                     max_tokens=16, max_retries=0)
    answer = llm.chat([ChatMessage(role="user", content=QUESTION[0]["content"])])
    assert answer.message.content == expected_chat(default_llm).outputs[0].text


def test_completions_take_text_token_and_array_prompts_with_echo_and_logprobs(client, default_llm):
    expected = default_llm.generate([COUNTING], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    token_ids = expected.prompt_token_ids
    response = client.completions.create(model="default", prompt=[COUNTING, COUNTING], max_tokens=6, temperature=0)
    assert [c.text for c in response.choices] == [expected.outputs[0].text] * 2 and [0, 1] == [
        c.index for c in response.choices]
    assert response.usage.completion_tokens == 12
    by_ids = client.completions.create(model="default", prompt=token_ids, max_tokens=6, temperature=0, echo=True,
                                       logprobs=1)
    choice = by_ids.choices[0]
    assert choice.text == default_llm.tokenizer.decode(token_ids) + expected.outputs[0].text
    assert len(choice.logprobs.tokens) == len(token_ids) + 6 and choice.logprobs.token_logprobs[0] is None
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset[len(token_ids)] == len(default_llm.tokenizer.decode(token_ids))
    chunks = list(client.completions.create(model="default", prompt=COUNTING, max_tokens=6, temperature=0,
                                            stream=True, n=2, seed=1))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: expected.outputs[0].text, 1: expected.outputs[0].text}  # greedy: both samples agree


def test_tokenize_counts_what_the_chat_endpoint_reads_and_detokenize_inverts_it(client, http):
    usage = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=2).usage
    tokenized = http.post("/tokenize", json={"model": "default", "messages": QUESTION}).json()
    assert tokenized["count"] == usage.prompt_tokens == len(tokenized["tokens"])
    assert tokenized["max_model_len"] > tokenized["count"]
    text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert "What is the capital of France?" in text
    assert http.post("/tokenize", json={"prompt": text}).json()["tokens"] == tokenized["tokens"]


def test_models_health_metrics_and_the_request_id(server, client, http, caplog):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"]
    assert httpx.get(f"{server.root_url}/health").json() == {"status": "ok"}  # open, no key
    metrics = httpx.get(f"{server.root_url}/metrics").text
    assert "vllm:num_requests_running" in metrics and "vllm:generation_tokens_total" in metrics
    with caplog.at_level("INFO", logger="hearth_llm.server"):
        echoed = http.get("/v1/models", headers={"X-Request-Id": "my-trace-42"})
        # The server thread writes its log line after the response has gone out: wait for it.
        deadline = time.monotonic() + 5
        while True:
            lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "hearth_llm.server"]
            matching = [line for line in lines if line["request_id"] == "my-trace-42"]
            if matching or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    assert echoed.headers["x-request-id"] == "my-trace-42"
    [line] = matching
    assert line["status"] == 200 and line["path"] == "/v1/models" and line["tenant"] == "key-0"
    assert len(http.get("/v1/models").headers["x-request-id"]) == 32  # one of ours when none is sent


# ---- errors -------------------------------------------------------------------------------------------

def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def chat_body(**fields) -> dict:
    return {"model": "default", "messages": QUESTION, "max_tokens": 4, **fields}


def test_a_missing_or_wrong_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"}):
        response = httpx.post(f"{server.url}/chat/completions", json=chat_body(), headers=headers)
        assert error_of(response, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="sk-wrong", max_retries=0).models.list()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat_body(model="gpt-4o")),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "Hi"}),
    ("/v1/embeddings", {"model": "SmolLM2-135M-Instruct", "input": "Hi"}),  # the chat model cannot embed
])
def test_an_unknown_model_is_404(http, path, body):
    error = error_of(http.post(path, json=body), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 3}, "temperature"),                # the engine's range check
    ({"temperature": "hot"}, "temperature"),            # a wrong type
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),               # the server's max_tokens_limit
    ({"n": 0}, "n"),
    ({"n": 100}, "n"),                                  # the server's max_n
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),              # without logprobs
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),       # no tools
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]}, "tools"),
    ({"response_format": {"type": "grammar"}}, "response_format"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"frobnicate": 1}, "frobnicate"),                  # unknown: refused, never ignored
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"stop": [""]}, "stop"),
])
def test_a_bad_parameter_is_400_naming_it(http, fields, param):
    error = error_of(http.post("/v1/chat/completions", json=chat_body(**fields)), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize("body, param", [
    ({"model": "default", "prompt": []}, "prompt"),
    ({"model": "default", "prompt": "Hi", "suffix": "x"}, "suffix"),
    ({"model": "default", "prompt": "Hi", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"model": "default", "prompt": [[10**9]]}, "prompt"),          # not in the vocabulary
    ({"model": "default", "prompt": "Hi", "max_tokens": 9000}, "max_tokens"),
    ({"model": "default", "prompt": [5, "Hi"]}, "prompt"),          # token ids and text mixed
    ({"model": "default", "prompt": [[5], "Hi"]}, "prompt"),
    ({"model": "default", "prompt": 5}, "prompt"),
])
def test_a_bad_completion_parameter_is_400_naming_it(http, body, param):
    assert error_of(http.post("/v1/completions", json=body), 400)["param"] == param


def test_each_prompt_form_is_read_as_itself_and_a_mixed_list_names_its_item():
    from pydantic import ValidationError

    from hearth_llm.server.app import validation_error
    from hearth_llm.server.protocol import CompletionRequest

    for prompt in ("Hi", ["Hi", "there"], list(range(1000)), [[1, 2], [3]], []):
        assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, "three"]})
    assert validation_error(raised.value.errors()).message == "prompt[2]: Input should be a valid integer"


def test_malformed_json_and_non_objects_are_400(http):
    for content in (b'{"model": "default", "messages": [', b"[1, 2]", b"not json"):
        error = error_of(http.post("/v1/chat/completions", content=content,
                                   headers={"Content-Type": "application/json"}), 400)
        assert "JSON" in error["message"]
    error = error_of(http.post("/v1/chat/completions", content=json.dumps(chat_body()),
                               headers={"Content-Type": "application/x-www-form-urlencoded"}), 400)
    assert "Content-Type: application/json" in error["message"]


def test_a_body_over_the_limit_is_413_whether_declared_or_streamed(server, http):
    huge = chat_body(messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}])
    assert error_of(http.post("/v1/chat/completions", json=huge), 413)["code"] == "request_too_large"

    def chunks():  # chunked transfer: no Content-Length to read the size from
        yield json.dumps(huge).encode()

    response = http.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert error_of(response, 413)["code"] == "request_too_large"


def test_a_timeout_is_504_and_frees_the_request(http, core):
    response = http.post("/v1/completions", json={"model": "default", "prompt": COUNTING, "max_tokens": 2000,
                                                  "ignore_eos": True}, headers={"X-Request-Timeout": "0.2"})
    assert error_of(response, 504)["code"] == "request_timeout"
    bad = error_of(http.post("/v1/completions", json={"model": "default", "prompt": "Hi"},
                             headers={"X-Request-Timeout": "soon"}), 400)
    assert bad["param"] == "X-Request-Timeout"


def test_an_overloaded_engine_is_503_with_retry_after():
    # A queue bound of one sequence, and a request of two: refused before the engine is even started.
    with start_server("default", max_waiting_requests=1, preload=False, embedding_model=None, **ENGINE) as small:
        response = httpx.post(f"{small.url}/completions", json={"model": "default", "prompt": ["a", "b"]})
        error = error_of(response, 503)
        assert error["code"] == "engine_overloaded" and response.headers["retry-after"] == "1"
        assert "max_waiting_requests=1" in error["message"]


def test_requests_over_their_keys_rate_wait_for_room(core):
    from hearth_llm.engine import RateLimit

    with start_server("default", api_key=["sk-a", "sk-b"], rate_limit=RateLimit(max_requests=1, period_s=1.5),
                      embedding_model=None, **ENGINE) as limited:  # the same engine: nothing to load
        def elapsed(key: str) -> float:
            started = time.monotonic()
            response = httpx.post(f"{limited.url}/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "default", "prompt": "Hi", "max_tokens": 1})
            assert response.status_code == 200, response.text
            return time.monotonic() - started

        same_key = elapsed("sk-a") + elapsed("sk-a")
        other_key = elapsed("sk-b")
    assert same_key >= 1.45    # the second waited for the first's window to pass
    assert other_key < 1.0     # another key has its own window


# ---- clients that leave, many clients, stopping ---------------------------------------------------------

def long_completion(**fields) -> dict:
    return {"model": "default", "prompt": COUNTING, "max_tokens": 3000, "ignore_eos": True, "temperature": 0, **fields}


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(http, core):
    with http.stream("POST", "/v1/completions", json=long_completion(stream=True)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data:"):
                events.append(line)
            if len(events) == 3:
                break
        assert core.stats()["num_running"] == 1
    wait_for_idle(core, timeout=5)  # well before 3000 tokens could have been generated


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_blocks(server, core):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/completions", json=long_completion(), headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(60, read=0.5))
    wait_for_idle(core, timeout=5)


def test_50_streaming_clients_30_percent_leaving_leave_the_pool_whole(server, core, default_llm):
    expected = expected_chat(default_llm, max_tokens=8).outputs[0].text

    async def one(session: httpx.AsyncClient, leaves: bool) -> str | None:
        body = chat_body(max_tokens=8, temperature=0, stream=True)
        async with session.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            text = ""
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if line == "data: [DONE]":
                    return text
                if leaves:
                    return None  # closes the connection after the first event
                text += json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
        raise AssertionError("the stream ended without [DONE]")

    async def run():
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=server.root_url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120, limits=limits) as session:
            return await asyncio.gather(*(one(session, index % 10 < 3) for index in range(50)))

    answers = asyncio.run(run())
    assert answers.count(None) == 15 and set(answers) == {None, expected}
    wait_for_idle(core)


def test_stopping_the_server_lets_a_stream_in_flight_finish(core, default_llm):
    expected = expected_chat(default_llm, max_tokens=24).outputs[0].text
    running = start_server("default", embedding_model=None, drain_timeout=30, **ENGINE)  # the same engine
    received = []
    with httpx.stream("POST", f"{running.url}/chat/completions", timeout=60,
                      json=chat_body(max_tokens=24, temperature=0, stream=True)) as response:
        lines = response.iter_lines()
        received.append(next(line for line in lines if line.startswith("data:")))
        stopper = threading.Thread(target=running.stop)
        stopper.start()
        received += [line for line in lines if line.startswith("data:")]
    stopper.join(30)
    assert received[-1] == "data: [DONE]"
    text = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content") or "" for line in received[:-1])
    assert text == expected
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{running.root_url}/health")
    assert not core.is_stopped  # the server let go of the engine; the session's LLM still holds it


def test_the_serve_command_reads_its_options_and_the_key_from_the_environment(monkeypatch):
    from hearth_llm.cli import main  # noqa: F401 - the script registers serve
    from hearth_llm.engine.cli import build_parser
    from hearth_llm.server.cli import add_serve_command, serve_kwargs

    parser, commands = build_parser()
    add_serve_command(commands)
    monkeypatch.setenv("HEARTH_API_KEY", "sk-env")
    args = parser.parse_args(["serve", "./model.gguf", "--max-num-seqs", "8", "--embedding-model", "none"])
    kwargs = serve_kwargs(args)
    assert args.model == "./model.gguf" and kwargs["host"] == "127.0.0.1" and kwargs["port"] == 8000
    assert kwargs["api_key"] == ["sk-env"] and kwargs["embedding_model"] is None and kwargs["max_num_seqs"] == 8
    args = parser.parse_args(["serve", "--api-key", "a", "--api-key", "b", "--host", "0.0.0.0"])
    assert serve_kwargs(args)["api_key"] == ["a", "b"] and serve_kwargs(args)["host"] == "0.0.0.0"
    assert "engine_core" not in serve_kwargs(parser.parse_args(["serve", "--device", "cpu"]))  # the engine's own
    assert serve_kwargs(parser.parse_args(["serve", "--engine-core", "process"]))["engine_core"] == "process"
    # on a GPU the engine loop gets its own process unless told otherwise
    assert serve_kwargs(parser.parse_args(["serve", "--device", "cuda"]))["engine_core"] == "process"
    assert serve_kwargs(parser.parse_args(["serve", "--device", "cuda:1", "--engine-core", "thread"]))[
        "engine_core"] == "thread"


def test_a_server_over_an_engine_core_in_its_own_process_streams_the_same_tokens():
    """``--engine-core process``: the engine loop runs in a child process (no shared interpreter lock
    with the HTTP loop); the same greedy completion as the in-thread engine, streamed."""
    prompt = "The capital of France is"
    body = {"model": "default", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    texts = {}
    for engine_core in ("process", "thread"):
        with start_server("default", preload=True, embedding_model=None, engine_core=engine_core, **ENGINE) as running:
            with httpx.stream("POST", f"{running.root_url}/v1/completions", json={**body, "stream": True},
                              timeout=60) as response:
                assert response.status_code == 200
                chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            texts[engine_core] = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert texts["process"] and texts["process"] == texts["thread"]


def test_the_server_maps_onto_public_engine_apis_only():
    """A thin mapper: no integration, benchmark or scheduler internals imported (tests/test_layering.py's scanner)."""
    from pathlib import Path

    from test_layering import imported_modules

    forbidden = ("hearth_llm.integrations", "hearth_llm.benchmarks", "hearth_llm.engine.scheduler",
                 "hearth_llm.engine.llm_engine", "hearth_llm.engine.kv_cache_manager", "hearth_llm.engine.model_runner")
    for path in sorted((Path(__file__).resolve().parent.parent / "server").glob("*.py")):
        names = imported_modules(path.read_text(), "hearth_llm.server")
        assert not [name for name in names if name.startswith(forbidden)], path
