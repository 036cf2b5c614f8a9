"""Two engine replicas as Ray actors on a local Ray (``ray.init(num_cpus=2)``), one tiny fp32 Llama:
tokens equal the single in-process engine, shared prefixes go to one replica and hit its cache, an
overloaded replica's prefix spills to the other, a closed stream frees its blocks on its replica,
a replica Ray restarts serves again, and a killed replica fails only its own requests while the
other keeps serving.

One Ray session and one replica set for the module (starting them is most of its time); the
kill test takes a replica down for good, so it runs last.
"""
from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer, LlamaConfig

ray = pytest.importorskip("ray", reason="the replica tests need Ray: pip install 'hearth-llm[ray]'")

from hearth_llm.engine import LLM, AsyncLLM, EngineDeadError, SamplingParams  # noqa: E402

from conftest import TINY_COMMON, random_prompts  # noqa: E402
from model_equality import save_tiny_model  # noqa: E402

BLOCK = 8
KW = dict(device="cpu", dtype="float32", show_progress=False, block_size=BLOCK, kv_cache_memory="8MiB",
          max_num_seqs=8)
REPLICAS = dict(replicas=2, backend="ray", max_load_gap=2, max_restarts=1)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = LlamaConfig(**TINY_COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    path = save_tiny_model(config, tmp_path_factory.mktemp("replica_model") / "llama", seed=3)
    tokenizer = AutoTokenizer.from_pretrained(path)  # a chat template, for ChatHearth
    tokenizer.chat_template = "{% for m in messages %}w5 {{ m['content'] }} w6 {% endfor %}w7"
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engine(model_dir):
    """An AsyncLLM on two replicas; LLM(model_dir, **KW, **REPLICAS) shares its replica set."""
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # a new local Ray, never a running one
    handle = AsyncLLM(model_dir, **KW, **REPLICAS)
    handle.core.wait_until_started()
    yield handle
    handle.close()
    ray.shutdown()


def replica_stats(engine) -> list[dict]:
    return engine.core.stats()["replicas"]


async def wait_until_idle(engine, timeout_s: float = 10.0) -> list[dict]:
    """Every live replica with no request and every block free, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [entry for entry in replica_stats(engine) if entry["is_alive"]]
        if all(e["num_running"] == 0 and e["num_waiting"] == 0 and e["num_free_blocks"] == e["num_total_blocks"]
               and e["num_outstanding"] == 0 for e in stats):
            return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.05)


def shared_prefix_prompts(count: int, seed: int) -> list[list[int]]:
    prefix = random_prompts(1, [3 * BLOCK], seed=seed)[0]
    return [prefix + tail for tail in random_prompts(count, [3], seed=seed + 1)]


async def test_two_replicas_give_the_single_engines_tokens(engine, model_dir):
    prompts = random_prompts(6, [5, 11, 17], seed=1)
    with LLM(model_dir, **KW, **REPLICAS) as replicated, LLM(model_dir, **KW) as single:
        assert replicated.engine.max_model_len == single.engine.max_model_len
        got = await asyncio.to_thread(replicated.generate, prompts, GREEDY, use_tqdm=False)
        want = single.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in got] == [out.outputs[0].token_ids for out in want]
    assert all(entry["num_routed"] >= 1 for entry in replica_stats(engine))  # both replicas served
    await wait_until_idle(engine)


def test_seeded_samples_of_a_request_equal_the_single_engines(engine, model_dir):
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=5)
    prompts = random_prompts(3, [6], seed=3)
    with LLM(model_dir, **KW, **REPLICAS) as replicated, LLM(model_dir, **KW) as single:
        got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (replicated, single))
    assert [[c.token_ids for c in out.outputs] for out in got] == [[c.token_ids for c in out.outputs] for out in want]


async def test_streamed_tokens_equal_the_batch_ones(engine, model_dir):
    prompt = random_prompts(1, [9], seed=2)[0]
    streamed = [token async for out in engine.generate(prompt, GREEDY) for token in out.delta_token_ids]
    with LLM(model_dir, **KW) as single:
        assert streamed == single.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_chat_hearth_on_replicas_answers_as_on_one_engine(engine, model_dir):
    pytest.importorskip("langchain_core")
    from hearth_llm.integrations.langchain import ChatHearth

    replicated = ChatHearth(model=model_dir, engine_kwargs={**KW, **REPLICAS}, max_tokens=5, temperature=0)
    single = ChatHearth(model=model_dir, engine_kwargs=KW, max_tokens=5, temperature=0)
    question = "w10 w11 w12"
    answer = single.invoke(question)
    assert replicated.invoke(question).content == answer.content
    assert "".join(chunk.content for chunk in replicated.stream(question)) == answer.content


async def test_shared_prefix_requests_go_to_one_replica_and_hit_its_cache(engine):
    before = replica_stats(engine)
    outputs = []
    for prompt in shared_prefix_prompts(4, seed=10):  # one at a time: no load to spill over
        outputs.append([out async for out in engine.generate(prompt, GREEDY)][-1])
    after = replica_stats(engine)
    routed = [a["num_routed"] - b["num_routed"] for a, b in zip(after, before)]
    hits = [a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before)]
    assert sorted(routed) == [0, 4]
    affine = routed.index(4)
    assert after[affine]["num_affine_routed"] - before[affine]["num_affine_routed"] == 3
    assert hits[affine] == 3 * 3 * BLOCK and hits[1 - affine] == 0
    assert [out.usage.cached_tokens for out in outputs] == [0, 3 * BLOCK, 3 * BLOCK, 3 * BLOCK]


async def test_an_overloaded_replica_spills_its_prefix_to_the_other(engine):
    prompts = shared_prefix_prompts(3, seed=20)
    ids = [f"spill-{index}" for index in range(3)]
    streams = engine.core.add_requests(prompts, [LONG] * 3, request_ids=ids)
    try:
        replicas = []
        for stream, request_id in zip(streams, ids):  # each has started: read its replica while it is in flight
            await stream.__aiter__().__anext__()
            replicas.append(engine.core.replica_of(request_id))
        # max_load_gap=2: the first two share a replica, the third finds it 2 ahead and goes to the other
        assert replicas[0] == replicas[1] != replicas[2]
        assert replica_stats(engine)[replicas[2]]["num_fallback_routed"] >= 1
    finally:
        for stream in streams:
            stream.close()
    await wait_until_idle(engine)


async def test_a_closed_stream_frees_its_blocks_on_its_replica(engine):
    request_id = "leaver"
    stream = engine.generate(random_prompts(1, [20], seed=30)[0], LONG, request_id=request_id)
    await stream.__anext__()
    replica = engine.core.replica_of(request_id)
    busy = replica_stats(engine)[replica]
    assert busy["num_running"] == 1 and busy["num_free_blocks"] < busy["num_total_blocks"]
    generated_before = busy["num_generation_tokens"]
    await stream.aclose()  # the reader leaves
    idle = (await wait_until_idle(engine, timeout_s=5.0))
    assert engine.core.replica_of(request_id) is None
    by_index = {entry["replica"]: entry for entry in idle}
    assert by_index[replica]["num_generation_tokens"] - generated_before < LONG.max_tokens  # cut short


@pytest.mark.parametrize("delay_s", [0.0, 0.3])
async def test_an_abort_ends_the_stream_whether_or_not_the_request_was_sent(engine, delay_s):
    stream = engine.core.add_request(random_prompts(1, [10], seed=60)[0], LONG, request_id=f"abort-{delay_s}")
    await asyncio.sleep(delay_s)
    await engine.abort(f"abort-{delay_s}")
    outputs = [out async for out in stream]
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert sum(len(out.delta_token_ids) for out in outputs) < LONG.max_tokens
    await wait_until_idle(engine)


def test_invalid_prompts_refuse_the_whole_batch_as_one_engine_does(engine):
    streams = engine.core.add_requests([[5, 6, 7], []], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="prompt must not be empty"):
        list(streams[1])
    with pytest.raises(ValueError, match="none was queued"):
        list(streams[0])
    busy = engine.core.add_request([5, 6, 7], LONG, request_id="taken")
    with pytest.raises(ValueError, match="'taken' is already in use"):
        list(engine.core.add_request([8, 9], GREEDY, request_id="taken"))
    busy.close()
    with pytest.raises(ValueError, match="temperature"):  # sampling parameters: at once, in the caller
        engine.core.add_request([5, 6], SamplingParams(temperature=-1))


async def test_a_replica_ray_restarts_serves_again(engine):
    stream = engine.generate(random_prompts(1, [12], seed=50)[0], LONG, request_id="restarted")
    await stream.__anext__()
    index = engine.core.replica_of("restarted")
    ray.kill(engine.core.replica_actor(index), no_restart=False)  # Ray restarts it (max_restarts=1)
    with pytest.raises(EngineDeadError, match=f"replica {index} of model"):
        async for _ in stream:
            pass
    deadline = time.monotonic() + 60.0
    while not (replica_stats(engine)[index]["is_alive"] and replica_stats(engine)[index]["num_restarts"] == 1):
        assert time.monotonic() < deadline, replica_stats(engine)
        await asyncio.sleep(0.2)
    before = [entry["num_routed"] for entry in replica_stats(engine)]
    prompts = random_prompts(2, [12], seed=51)  # two new prefixes at once: one per replica
    streams = engine.core.add_requests(prompts, [GREEDY] * 2)
    outputs = [[out async for out in stream] for stream in streams]
    assert all(len([t for out in outs for t in out.delta_token_ids]) == GREEDY.max_tokens for outs in outputs)
    assert [entry["num_routed"] - b for entry, b in zip(replica_stats(engine), before)] == [1, 1]
    await wait_until_idle(engine)


async def test_a_killed_replica_fails_its_requests_and_the_other_keeps_serving(engine):
    prompts = random_prompts(2, [12], seed=40)
    doomed = engine.generate(prompts[0], LONG, request_id="doomed")
    survivor = engine.generate(prompts[1], LONG, request_id="survivor")
    first = [await doomed.__anext__(), await survivor.__anext__()]
    dead, alive = engine.core.replica_of("doomed"), engine.core.replica_of("survivor")
    assert dead is not None and alive is not None and dead != alive

    ray.kill(engine.core.replica_actor(dead), no_restart=True)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=f"replica {dead} of model"):
        async for _ in doomed:
            pass
    assert time.monotonic() - started < 10.0

    tokens = list(first[1].delta_token_ids)
    async for out in survivor:
        tokens += out.delta_token_ids
    assert len(tokens) == LONG.max_tokens  # the other replica's request finished whole

    after = [out async for out in engine.generate(prompts[0], GREEDY)]  # new requests go to the live replica
    assert after[-1].finished and len([t for out in after for t in out.delta_token_ids]) == GREEDY.max_tokens
    stats = engine.core.stats()
    assert stats["num_live_replicas"] == 1
    assert stats["replicas"][dead]["is_alive"] is False and "ActorDiedError" in stats["replicas"][dead]["last_error"]
    assert stats["replicas"][alive]["num_routed"] >= 2
