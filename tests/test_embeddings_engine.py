"""The embedding engine: batching across callers, bad input, failures, shutdown."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hearth_llm.embeddings import (EmbeddingConfig, EmbeddingEngine, EmbeddingEngineClosedError,
                                   EmbeddingEngineDeadError, EmbeddingFailedError, TextTooLongError,
                                   default_model_path, get_embedding_engine, shutdown_embedding_engines)
from hearth_llm.embeddings.batching import fair_shares, plan_batches

LONG_TEXT = "word " * 400   # ~400 tokens, over all-MiniLM-L6-v2's max_seq_length of 256


@pytest.fixture(scope="module")
def engine():
    """The default model on an engine of this module's own (tests here patch and cancel on it)."""
    with EmbeddingEngine(EmbeddingConfig(show_progress=False)) as engine:
        engine.start()
        yield engine


def num_batches(engine: EmbeddingEngine) -> int:
    return engine.stats()["num_batches"]


# ---- batch planning -------------------------------------------------------------------------

def test_batches_group_similar_lengths_longest_first():
    assert plan_batches([3, 10, 4, 9], max_batch_tokens=20, max_batch_size=8) == [[1, 3], [2, 0]]


def test_a_batch_never_exceeds_its_padded_token_budget_or_size():
    lengths = [5, 17, 3, 30, 8, 8, 12, 1, 25, 9] * 7
    batches = plan_batches(lengths, max_batch_tokens=64, max_batch_size=4)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) <= 4
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 64


def test_a_text_longer_than_the_budget_runs_alone():
    assert plan_batches([100, 2, 2], max_batch_tokens=10, max_batch_size=8) == [[0], [1, 2]]


def test_short_texts_never_share_a_batch_with_longer_ones_when_asked():
    lengths = [3, 12, 4, 2, 9, 4]
    batches = plan_batches(lengths, max_batch_tokens=100, max_batch_size=8, split_below=4)
    assert batches == [[1, 4, 2, 5], [0, 3]]
    assert plan_batches(lengths, max_batch_tokens=100, max_batch_size=8) == [[1, 4, 2, 5, 0, 3]]


def test_a_short_request_behind_a_large_one_gets_its_share_at_once():
    assert fair_shares([10_000, 1], budget=256) == [255, 1]
    assert fair_shares([3, 2], budget=256) == [3, 2]
    assert sum(fair_shares([100] * 10, budget=64)) == 64


# ---- batching across callers ----------------------------------------------------------------

async def test_64_concurrent_queries_share_at_most_two_forward_passes(engine):
    queries = [f"question number {i} about topic {i % 7}" for i in range(64)]
    before = num_batches(engine)
    vectors = await asyncio.gather(*(engine.aembed_one(query) for query in queries))
    assert num_batches(engine) - before <= 2
    expected = engine.embed(queries)
    assert torch.allclose(torch.stack(vectors), expected, atol=batching_tolerance(engine))


def test_concurrent_threads_get_their_own_results(engine):
    texts = [f"thread {i} says hello" for i in range(16)]
    expected = engine.embed(texts)
    results: dict[int, torch.Tensor] = {}

    def worker(i: int) -> None:
        results[i] = engine.embed_one(texts[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.allclose(torch.stack([results[i] for i in range(16)]), expected, atol=1e-5)


def test_results_keep_the_callers_order(engine):
    texts = ["x " * n for n in (30, 1, 12, 5, 60)]
    together = engine.embed(texts)
    for i, text in enumerate(texts):
        assert torch.allclose(together[i], engine.embed_one(text), atol=1e-5)


async def test_the_event_loop_keeps_running_while_the_model_works(engine):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    await engine.aembed([f"sentence {i} " * 20 for i in range(64)])
    task.cancel()
    assert ticks > 0


def batching_tolerance(engine) -> float:
    """How far one text's vector may move with its batch mates. float32 is exact to 1e-5; in mixed
    precision, AMX's bf16 kernels (Intel Xeon) pick their blocking per batch shape and thread
    split, which moved vectors by up to 4.3e-5 there (AVX-512 BF16 on AMD stays within 1e-5)."""
    return 1e-5 if engine.precision == "float32" else 1e-4


def test_side_by_side_workers_give_the_vectors_of_a_single_thread(monkeypatch):
    # float32: the split into workers must change nothing but the thread (mixed precision's
    # rounding on AMX depends on the thread split; see batching_tolerance).
    texts = [f"sentence {i} " + "word " * (i % 23) for i in range(300)]
    with EmbeddingEngine(EmbeddingConfig(num_workers=1, max_batch_size=16, show_progress=False,
                                         dtype="float32")) as serial:
        expected = serial.embed(texts)
    with EmbeddingEngine(EmbeddingConfig(num_workers=2, max_batch_size=16, show_progress=False,
                                         dtype="float32")) as parallel:
        parallel.start()
        threads_used = set()
        original = parallel._runner.run

        def run(token_ids):
            threads_used.add(threading.current_thread().name)
            return original(token_ids)

        monkeypatch.setattr(parallel._runner, "run", run)
        assert torch.allclose(parallel.embed(texts), expected, atol=1e-5)
    assert all(name.startswith("hearth-embeddings-worker") for name in threads_used)
    assert len(threads_used) == 2


def test_the_cuda_pipeline_gives_the_vectors_of_the_serial_engine_settling_batches_in_order(monkeypatch):
    # The CUDA scheduling, run on the CPU: one worker only queues each batch (runner.launch), the
    # engine thread waits for the oldest while it takes and tokenizes the next steps.
    texts = [f"sentence {i} " + "word " * (i % 23) for i in range(300)]
    config = dict(num_workers=1, max_batch_size=16, show_progress=False, dtype="float32")
    with EmbeddingEngine(EmbeddingConfig(**config)) as serial:
        expected = serial.embed(texts)
    pipelined = EmbeddingEngine(EmbeddingConfig(**config))
    pipelined._runs_on_gpu = True
    with pipelined:
        pipelined.start()
        launched_on, waited_for = [], []
        original = pipelined._runner.launch

        def launch(token_ids):
            pending = original(token_ids)
            launched_on.append(threading.current_thread().name)
            number, wait = len(launched_on), pending.wait
            pending.wait = lambda: waited_for.append(number) or wait()
            return pending

        monkeypatch.setattr(pipelined._runner, "launch", launch)
        actual = pipelined.embed(texts)
        num_steps = pipelined.stats()["num_steps"]
    assert torch.allclose(actual, expected, atol=1e-5)
    assert num_steps > 2 and len(launched_on) >= num_steps - 1   # all but maybe a lone last one
    assert all(name.startswith("hearth-embeddings-worker") for name in launched_on)
    assert waited_for == sorted(waited_for) == list(range(1, len(launched_on) + 1))


def test_workers_run_on_one_thread_each_and_leave_the_process_its_thread_count(monkeypatch):
    num_threads = torch.get_num_threads()
    with EmbeddingEngine(EmbeddingConfig(num_workers=2, max_batch_size=4, show_progress=False)) as engine:
        engine.start()
        threads_per_worker = set()
        original = engine._runner.run

        def run(token_ids):
            threads_per_worker.add(torch.get_num_threads())
            return original(token_ids)

        monkeypatch.setattr(engine._runner, "run", run)
        engine.embed([f"text {i}" for i in range(40)])
    assert threads_per_worker == {1}
    started_later = []
    thread = threading.Thread(target=lambda: started_later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert torch.get_num_threads() == num_threads and started_later == [num_threads]


def test_a_step_takes_four_batches_per_worker():
    with EmbeddingEngine(EmbeddingConfig(num_workers=3, max_batch_size=4, show_progress=False)) as engine:
        engine.embed([f"text {i}" for i in range(48)])
        assert engine.stats()["num_steps"] == 1


# ---- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("texts, error, message", [
    ([], ValueError, "texts must be a non-empty list"),
    ("just a string", TypeError, "texts must be a list of str.*wrap a single text"),
    (["ok", 3], TypeError, r"texts\[1\] must be a str, got int"),
    ([None], TypeError, r"texts\[0\] must be a str, got NoneType"),
    (42, TypeError, "texts must be a list of str, got int"),
])
def test_bad_texts_are_refused_naming_the_argument(engine, texts, error, message):
    with pytest.raises(error, match=message):
        engine.embed(texts)


def test_a_non_string_single_text_is_refused_naming_the_argument(engine):
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        engine.embed_one(b"bytes")


def test_an_overlong_text_is_refused_when_truncation_is_off(engine):
    with pytest.raises(TextTooLongError, match=r"texts\[1\] has more than max_seq_length=256 tokens"):
        engine.embed(["fine", LONG_TEXT], truncate=False)


def test_an_overlong_text_is_truncated_at_max_seq_length_by_default(engine):
    truncated_by_hand = " ".join(LONG_TEXT.split()[:254])   # 254 words + [CLS] + [SEP] = 256 tokens
    assert torch.allclose(engine.embed_one(LONG_TEXT), engine.embed_one(truncated_by_hand), atol=1e-5)


def test_max_seq_length_is_configurable():
    with EmbeddingEngine(EmbeddingConfig(max_seq_length=8, show_progress=False)) as short:
        assert short.max_seq_length == 8
        with pytest.raises(TextTooLongError, match="max_seq_length=8"):
            short.embed(["one two three four five six seven"], truncate=False)
        assert short.embed(["one two three four five six"], truncate=False).shape == (1, 384)


@pytest.mark.parametrize("options, message", [
    ({"max_batch_tokens": 0}, "max_batch_tokens must be a positive int"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"implementation": "onnx"}, "implementation must be one of"),
    ({"max_seq_length": 1}, "max_seq_length must be at least 2"),
    ({"num_workers": 0}, "num_workers must be a positive int"),
    ({"batch_size": 8}, "unknown embedding engine option"),
])
def test_bad_engine_options_are_refused_by_name(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        get_embedding_engine("default", **options)


# ---- failures and progress ------------------------------------------------------------------

def fail_batches_with_long_texts(engine, monkeypatch) -> None:
    """The engine's forward pass raises for any batch holding a text of more than 100 tokens."""
    original = engine._runner.run

    def run(token_ids):
        if any(len(ids) > 100 for ids in token_ids):
            raise RuntimeError("boom")
        return original(token_ids)

    monkeypatch.setattr(engine._runner, "run", run)


def test_a_failing_batch_fails_only_its_requests(engine, monkeypatch):
    fail_batches_with_long_texts(engine, monkeypatch)
    with pytest.raises(EmbeddingFailedError, match="boom"):
        engine.embed([LONG_TEXT])
    assert engine.embed(["still serving"]).shape == (1, 384)


def test_a_failing_batch_on_a_worker_fails_only_its_requests(monkeypatch):
    with EmbeddingEngine(EmbeddingConfig(num_workers=2, max_batch_size=2, show_progress=False)) as engine:
        engine.start()
        fail_batches_with_long_texts(engine, monkeypatch)
        failing = engine.submit([LONG_TEXT, "a", "b"])
        fine = engine.submit(["c", "d", "e", "f"])
        with pytest.raises(EmbeddingFailedError, match="boom"):
            failing.result(timeout=60)
        assert fine.result(timeout=60).shape == (4, 384)


def test_a_text_the_tokenizer_cannot_read_fails_only_its_request(engine):
    with pytest.raises(ValueError, match=r"texts\[1\] cannot be tokenized"):
        engine.embed(["fine", "lone surrogate \ud800"])
    assert engine.embed(["still serving"]).shape == (1, 384)


def test_a_crash_of_the_engine_thread_fails_the_requests_in_flight_instead_of_hanging(monkeypatch):
    engine = EmbeddingEngine(EmbeddingConfig(show_progress=False))
    engine.start()
    monkeypatch.setattr(engine, "_run_step", lambda items: 1 / 0)
    with pytest.raises(EmbeddingEngineDeadError, match="crashed: ZeroDivisionError") as info:
        engine.embed(["in flight"], timeout=30)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    engine.close()
    assert not engine._thread.is_alive()


def test_a_model_that_fails_to_load_fails_its_requests_with_the_cause(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "hidden_size": 8, "max_position_embeddings": 16}')
    engine = EmbeddingEngine(EmbeddingConfig(model=str(tmp_path)))
    with pytest.raises(EmbeddingEngineDeadError, match="loading the embedding model") as info:
        engine.embed(["hello"])
    assert info.value.__cause__ is not None
    with pytest.raises(EmbeddingEngineDeadError):
        engine.embed(["again"])
    engine.close()


def test_a_large_request_shows_a_progress_bar(engine, capsys):
    engine.embed([f"text {i}" for i in range(40)], show_progress=True)
    assert "40/40" in capsys.readouterr().err


async def test_a_cancelled_request_stops_being_computed(engine):
    texts = [f"cancel me {i}" for i in range(3000)]   # twelve steps of 256 texts
    before = engine.stats()["num_texts"]
    task = asyncio.create_task(engine.aembed(texts, show_progress=False))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.embed(["after the cancel"]).shape == (1, 384)
    assert engine.stats()["num_texts"] - before < len(texts)


# ---- lifecycle ------------------------------------------------------------------------------

def test_close_fails_waiting_requests_and_joins_the_thread():
    engine = EmbeddingEngine(EmbeddingConfig(show_progress=False))
    engine.start()
    future = engine.submit([f"pending {i}" for i in range(20_000)])   # many steps: most still waiting
    engine.close()
    assert not engine._thread.is_alive()
    with pytest.raises(EmbeddingEngineClosedError):
        future.result(timeout=10)
    with pytest.raises(EmbeddingEngineClosedError):
        engine.embed(["after close"])


def test_an_engine_that_never_ran_closes_without_a_thread():
    engine = EmbeddingEngine(EmbeddingConfig())
    engine.close()
    assert engine._thread is None and engine.is_stopped


def test_one_engine_per_model_and_a_fresh_one_after_shutdown():
    first = get_embedding_engine("default")
    assert get_embedding_engine(str(default_model_path()), show_progress=True) is first
    assert get_embedding_engine("default", max_batch_tokens=1024) is not first
    shutdown_embedding_engines()
    assert first.is_stopped
    second = get_embedding_engine("default")
    assert second is not first and second.embed(["fresh"]).shape == (1, 384)
