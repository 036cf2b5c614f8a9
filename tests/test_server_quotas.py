"""Per-key quotas (requests and tokens per minute: 429 with OpenAI's body and Retry-After) and the
server's queue bound (503), on a tiny model so that the tests start no real model."""
from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import openai
import pytest

from hearth_llm.engine import get_engine
from hearth_llm.server import start_server
from hearth_llm.server.quotas import APIKey, KeyQuotas, QuotaExceededError, read_keys_file

TINY = {"dtype": "float32", "max_num_seqs": 2, "show_progress": False}
PROMPT = "w5 w6 w7 w8"  # the tiny tokenizer's words


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the quota arithmetic -------------------------------------------------------------------------

def test_a_key_over_its_requests_per_minute_waits_for_its_oldest_request_to_age_out():
    clock = FakeClock()
    quotas = KeyQuotas({"key-0": APIKey("sk-a", requests_per_minute=2)}, clock=clock)
    assert quotas.admit("key-0")["x-ratelimit-remaining-requests"] == "1"
    clock.now += 10
    assert quotas.admit("key-0")["x-ratelimit-remaining-requests"] == "0"
    clock.now += 10
    with pytest.raises(QuotaExceededError) as refused:
        quotas.admit("key-0")
    assert refused.value.kind == "requests" and refused.value.retry_after == pytest.approx(40.0)
    assert refused.value.headers["Retry-After"] == "40" and "Limit 2, Used 2" in str(refused.value)
    clock.now += 40  # the first request is 60 s old: out of the window
    quotas.admit("key-0")


def test_a_key_over_its_tokens_per_minute_waits_until_enough_tokens_age_out():
    clock = FakeClock()
    quotas = KeyQuotas({"key-0": APIKey("sk-a", tokens_per_minute=30)}, clock=clock)
    quotas.admit("key-0")
    quotas.charge("key-0", 20)
    clock.now += 30
    assert quotas.admit("key-0")["x-ratelimit-remaining-tokens"] == "10"  # 20 used: still under 30
    quotas.charge("key-0", 20)
    clock.now += 1
    with pytest.raises(QuotaExceededError) as refused:
        quotas.admit("key-0")
    # 40 used; below 30 again once the first 20 leave the window, 29 s from now
    assert refused.value.kind == "tokens" and refused.value.retry_after == pytest.approx(29.0)
    clock.now += 29
    quotas.admit("key-0")


def test_keys_without_quotas_and_unknown_tenants_pass_untouched():
    quotas = KeyQuotas({"key-0": APIKey("sk-a"), "key-1": APIKey("sk-b", requests_per_minute=1)})
    for _ in range(5):
        assert quotas.admit("key-0") == {} and quotas.admit("anonymous") == {}
    quotas.admit("key-1")
    with pytest.raises(QuotaExceededError):
        quotas.admit("key-1")


@pytest.mark.parametrize("spec, expected", [
    ("sk-a", APIKey("sk-a")),
    ("sk-a:60", APIKey("sk-a", 60)),
    ("sk-a:60:40000", APIKey("sk-a", 60, 40000)),
    ("sk-a::40000", APIKey("sk-a", None, 40000)),
])
def test_api_key_specs_parse(spec, expected):
    assert APIKey.parse(spec) == expected


@pytest.mark.parametrize("spec, message", [("sk-a:x", "requests per minute"), ("sk-a:1:2:3", "expected KEY"),
                                           ("sk-a:0", "requests_per_minute"), (":5", "non-empty")])
def test_bad_api_key_specs_are_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        APIKey.parse(spec)


def test_the_serve_command_reads_quotas_from_flags_and_a_keys_file(tmp_path):
    from hearth_llm.engine.cli import build_parser
    from hearth_llm.server.cli import add_serve_command, serve_kwargs

    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# team keys\nsk-file-a:10:5000\n\nsk-file-b  # no quota\n")
    parser, commands = build_parser()
    add_serve_command(commands)
    args = parser.parse_args(["serve", "--api-key", "sk-a:60:40000", "--api-key", "sk-b", "--api-keys-file",
                              str(keys_file), "--max-queued-requests", "64"])
    kwargs = serve_kwargs(args)
    assert kwargs["api_key"] == [APIKey("sk-a", 60, 40000), "sk-b", APIKey("sk-file-a", 10, 5000), "sk-file-b"]
    assert kwargs["max_queued_requests"] == 64
    keys_file.write_text("sk-ok\nsk-bad:lots\n")
    with pytest.raises(ValueError, match="keys.txt:2"):
        read_keys_file(str(keys_file))


# ---- over HTTP ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tiny_model_dirs):
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def quota_server(tiny_model):
    keys = [APIKey("sk-rpm", requests_per_minute=2), APIKey("sk-tpm", tokens_per_minute=30), "sk-free"]
    with start_server(tiny_model, api_key=keys, embedding_model=None, **TINY) as running:
        yield running


def complete(server, key: str, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": "default", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields})


def assert_quota_error(response: httpx.Response, kind: str) -> dict:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and error["code"] == "rate_limit_exceeded"
    assert 1 <= int(response.headers["retry-after"]) <= 60
    return error


def test_a_key_past_its_requests_per_minute_gets_429_with_retry_after(quota_server):
    first, second = complete(quota_server, "sk-rpm"), complete(quota_server, "sk-rpm")
    assert first.status_code == second.status_code == 200
    assert [first.headers["x-ratelimit-remaining-requests"], second.headers["x-ratelimit-remaining-requests"]] \
        == ["1", "0"] and first.headers["x-ratelimit-limit-requests"] == "2"
    error = assert_quota_error(complete(quota_server, "sk-rpm"), "requests")
    assert "RPM" in error["message"]
    client = openai.OpenAI(base_url=quota_server.url, api_key="sk-rpm", max_retries=0)
    with pytest.raises(openai.RateLimitError):  # what OpenAI's client makes of it
        client.completions.create(model="default", prompt=PROMPT, max_tokens=2)
    assert complete(quota_server, "sk-free").status_code == 200  # another key is not held back


def test_a_key_past_its_tokens_per_minute_gets_429_after_its_answers_used_them(quota_server):
    streamed = complete(quota_server, "sk-tpm", max_tokens=10, stream=True, stream_options={"include_usage": True})
    usage = [json.loads(line[5:])["usage"] for line in streamed.text.splitlines()
             if line.startswith("data: {") and '"usage":{' in line][-1]
    assert streamed.status_code == 200 and usage["total_tokens"] < 30  # under the quota: admitted again
    assert complete(quota_server, "sk-tpm", max_tokens=20).status_code == 200  # now past 30 tokens
    error = assert_quota_error(complete(quota_server, "sk-tpm"), "tokens")
    assert "TPM" in error["message"] and "Limit 30" in error["message"]


def test_a_stream_the_client_leaves_is_charged_the_tokens_it_was_sent(tiny_model):
    with start_server(tiny_model, api_key=[APIKey("sk-left", tokens_per_minute=3)], embedding_model=None,
                      **TINY) as running:
        body = {"model": "default", "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{running.url}/completions", json=body, timeout=30,
                          headers={"Authorization": "Bearer sk-left"}) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                if len(events) == 4:
                    break
        deadline = time.monotonic() + 10
        while (refused := complete(running, "sk-left")).status_code == 200:  # charged once the abort lands
            assert time.monotonic() < deadline, "the stream left was never charged"
            time.sleep(0.05)
        assert_quota_error(refused, "tokens")


# ---- the queue bound ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_tiny_model(tiny_model, tmp_path_factory):
    """The tiny llama with room for 32k positions: a held stream of 30,000 tokens outlives the test
    even on a fast core (a 900-token one could finish, free its slot and let the probe in)."""
    path = tmp_path_factory.mktemp("long_tiny") / "llama"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 32768
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("engine_core", ["thread", "process"])  # a process core counts in its child
def test_requests_past_the_servers_queue_bound_get_503_and_the_pool_comes_back(long_tiny_model, engine_core):
    tiny_model = long_tiny_model
    core = get_engine(tiny_model, engine_core=engine_core, **TINY)

    def num_waiting() -> int:
        stats = core.stats()
        return stats.get("num_waiting", 0) + stats.get("num_queued", 0)

    async def until(condition) -> None:
        deadline = time.monotonic() + 30  # generous: a loaded 2-core runner starves the server thread
        while not condition():
            assert time.monotonic() < deadline, core.stats()
            await asyncio.sleep(0.01)

    with start_server(tiny_model, max_queued_requests=1, embedding_model=None, engine_core=engine_core,
                      **TINY) as running:
        async def run() -> httpx.Response:
            async with httpx.AsyncClient(base_url=running.url, timeout=30) as session:
                async def hold() -> None:  # a stream that runs until it is cancelled
                    body = {"model": "default", "prompt": PROMPT, "max_tokens": 30000, "ignore_eos": True,
                            "stream": True}
                    async with session.stream("POST", "/completions", json=body) as response:
                        assert response.status_code == 200
                        async for _ in response.aiter_lines():
                            pass

                holders = []
                try:
                    for running_count in (1, 2):  # one at a time: two at once may find the first still queued
                        holders.append(asyncio.create_task(hold()))  # both run (max_num_seqs=2)
                        await until(lambda: core.stats().get("num_running") == running_count)
                    holders.append(asyncio.create_task(hold()))  # admitted: nothing waits yet
                    await until(lambda: num_waiting() == 1)
                    # The refusal needs no engine step, but with a thread core the server shares one GIL
                    # with two streams decoding flat out and this client: a loaded runner took over
                    # 30 s to answer (CI dry run, 2026-12-03). A request that was queued, not refused,
                    # would never answer, so the longer wait still fails that case.
                    return await session.post("/completions", json={"model": "default", "prompt": PROMPT},
                                              timeout=120)
                finally:
                    for task in holders:
                        task.cancel()
                    await asyncio.gather(*holders, return_exceptions=True)

        refused = asyncio.run(run())
        deadline = time.monotonic() + 10
        while (stats := core.stats())["num_free_blocks"] != stats["num_total_blocks"] or stats["num_running"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.02)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "engine_overloaded" and "max_queued_requests=1" in error["message"]
    assert refused.headers["retry-after"] == "1"
