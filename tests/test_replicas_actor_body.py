"""The replica actor's body without Ray: one EngineCore whose outputs, for every request on it, come
back through one outbox the driver long-polls; errors travel as items; an abort ends the request."""
from __future__ import annotations

import asyncio

import pytest
from transformers import LlamaConfig

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.replicas.replica_actor import EngineReplica

from conftest import TINY_COMMON, random_prompts
from model_equality import save_tiny_model

KW = dict(device="cpu", dtype="float32", show_progress=False, block_size=8, kv_cache_memory="8MiB", num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = LlamaConfig(**TINY_COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return str(save_tiny_model(config, tmp_path_factory.mktemp("replica_body") / "llama", seed=4))


@pytest.fixture
async def replica(model_dir):
    body = EngineReplica(model_dir, KW)
    facts = await body.start()
    assert facts.max_model_len > 0 and facts.tokenizer is not None and facts.config.block_size == 8
    yield body
    await body.close()


async def drain(body: EngineReplica, request_ids: set[str]) -> tuple[dict[str, list], int]:
    """Poll until every request's last item came; the items by request, and how many polls it took."""
    items: dict[str, list] = {request_id: [] for request_id in request_ids}
    done, num_polls = set(), 0
    while done != request_ids:
        num_polls += 1
        for request_id, item in await body.poll(wait_s=5.0):
            items[request_id].append(item)
            if isinstance(item, BaseException) or item.finished:
                done.add(request_id)
    return items, num_polls


async def test_a_polls_reply_carries_every_requests_outputs(replica, model_dir):
    prompts = random_prompts(3, [6, 9, 12], seed=5)
    await replica.add([(f"r{i}", prompt, GREEDY, 0, None) for i, prompt in enumerate(prompts)], None, None)
    items, num_polls = await drain(replica, {"r0", "r1", "r2"})
    tokens = [[t for out in items[f"r{i}"] for t in out.delta_token_ids] for i in range(3)]
    with LLM(model_dir, **KW) as single:
        assert tokens == [out.outputs[0].token_ids for out in single.generate(prompts, GREEDY, use_tqdm=False)]
    # 3 requests x 5 tokens = 15 outputs in 5 steps of 3; a poll takes whole steps' outputs (never a
    # part of one, however the engine thread and the poller interleave)
    assert num_polls <= 5, num_polls


async def test_errors_travel_as_items(replica):
    await replica.add([("bad", [5, 6, 10_000], GREEDY, 0, None)], None, None)  # a token id past the vocabulary
    items, _ = await drain(replica, {"bad"})
    assert isinstance(items["bad"][-1], ValueError) and "token ids must be in" in str(items["bad"][-1])


async def test_an_abort_ends_the_request_with_an_abort_output(replica):
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    await replica.add([("long", [5, 6, 7], long, 0, None)], None, None)
    first = await replica.poll(wait_s=5.0)
    assert first and first[0][0] == "long"
    await replica.abort("long")
    items, _ = await drain(replica, {"long"})
    assert items["long"][-1].finish_reason == "abort"
    for _ in range(100):  # the counters follow at the engine's next turn
        stats = await replica.stats()
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
            break
        await asyncio.sleep(0.05)
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"], stats


async def test_an_empty_poll_returns_after_its_wait(replica):
    assert await asyncio.wait_for(replica.poll(wait_s=0.05), 5.0) == []
