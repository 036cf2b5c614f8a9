"""200 streaming clients on one in-process server (a tiny model): every answer complete and equal to
the same prompt run alone, the clients that leave mid-stream aborted, and the KV pool whole after."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from hearth_llm.engine import LLM, SamplingParams, get_engine
from hearth_llm.server import start_server

ENGINE = {"dtype": "float32", "max_num_seqs": 256, "show_progress": False}
NUM_CLIENTS = 200
NUM_PROMPTS = 20
MAX_TOKENS = 8
LEAVER_MAX_TOKENS = 900  # what a leaver would cost if its request were not aborted


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dirs):
    return str(tiny_model_dirs["llama"])


def prompts() -> list[list[int]]:
    rng = random.Random(21)
    return [[rng.randrange(4, 320) for _ in range(rng.randint(3, 24))] for _ in range(NUM_PROMPTS)]


def alone(model: str) -> list[str]:
    """Each prompt's greedy answer, run by itself (one request in the engine at a time)."""
    llm = LLM(model, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text for prompt in prompts()]


async def one_client(session: httpx.AsyncClient, prompt: list[int], leaves: bool) -> dict | None:
    body = {"model": "default", "prompt": prompt, "temperature": 0, "ignore_eos": True, "stream": True,
            "max_tokens": LEAVER_MAX_TOKENS if leaves else MAX_TOKENS, "stream_options": {"include_usage": True}}
    text, finish_reason, usage = "", None, None
    async with session.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            if leaves:
                return None  # closes the connection after the first event
            if line == "data: [DONE]":
                return {"text": text, "finish_reason": finish_reason, "usage": usage}
            chunk = json.loads(line[5:])
            for choice in chunk["choices"]:
                text += choice["text"]
                finish_reason = choice["finish_reason"] or finish_reason
            usage = chunk.get("usage") or usage
    raise AssertionError("the stream ended without [DONE]")


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_200_streaming_clients_get_the_answers_of_their_prompts_alone_and_leavers_are_aborted(tiny_model, engine_core):
    expected = alone(tiny_model)
    core = get_engine(tiny_model, engine_core=engine_core, **ENGINE)
    core.wait_until_started()  # (the process core's counters come once its child has loaded)
    num_generated_before = core.stats()["num_generation_tokens"]
    all_prompts = prompts()
    leaves = [index % 10 < 3 for index in range(NUM_CLIENTS)]  # 30 % leave after their first event

    async def run() -> list[dict | None]:
        async with httpx.AsyncClient(base_url=running.root_url, timeout=60,
                                     limits=httpx.Limits(max_connections=NUM_CLIENTS + 10)) as session:
            return await asyncio.gather(*(one_client(session, all_prompts[index % NUM_PROMPTS], leaves[index])
                                          for index in range(NUM_CLIENTS)))

    with start_server(tiny_model, embedding_model=None, engine_core=engine_core, **ENGINE) as running:
        answers = asyncio.run(run())
        deadline = time.monotonic() + 10
        while True:  # the engine's counters are as of its last step: poll
            stats = core.stats()
            if stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0 \
                    and stats["num_waiting"] == 0 and stats["num_queued"] == 0:
                break
            assert time.monotonic() < deadline, f"the pool did not come back: {stats}"
            time.sleep(0.02)

    for index, answer in enumerate(answers):
        if leaves[index]:
            assert answer is None
            continue
        assert answer["text"] == expected[index % NUM_PROMPTS], f"client {index}"
        assert answer["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == MAX_TOKENS
        assert answer["usage"]["prompt_tokens"] == len(all_prompts[index % NUM_PROMPTS])
    num_leavers = sum(leaves)
    num_generated = core.stats()["num_generation_tokens"] - num_generated_before
    # had the leavers' requests run on, they alone would have generated num_leavers * 900 tokens
    assert num_generated < (NUM_CLIENTS - num_leavers) * MAX_TOKENS + num_leavers * LEAVER_MAX_TOKENS // 3, \
        num_generated


def test_outputs_that_arrived_together_for_one_choice_go_out_as_one():
    """A server loop that fell behind the engine sends the outputs waiting for a choice as one event."""
    from hearth_llm.engine import StreamOutput
    from hearth_llm.server.completions import _coalesced

    def output(sample: int, text: str, token_ids: list[int], **fields) -> StreamOutput:
        return StreamOutput("cmpl-0", text, token_ids, index=sample, logprobs=[{t: t} for t in token_ids], **fields)

    arrived = [(0, output(0, "a", [1])), (0, output(0, "b", [2])), (0, output(1, "c", [3])),
               (0, output(1, "d", [4], finish_reason="length")), (0, output(1, "x", [9])), (1, output(0, "e", [5]))]
    merged = [(prompt, out.index, out.delta_text, out.delta_token_ids, out.logprobs, out.finish_reason)
              for prompt, out in _coalesced(arrived)]
    assert merged == [(0, 0, "ab", [1, 2], [{1: 1}, {2: 2}], None), (0, 1, "cd", [3, 4], [{3: 3}, {4: 4}], "length"),
                      (0, 1, "x", [9], [{9: 9}], None), (1, 0, "e", [5], [{5: 5}], None)]
