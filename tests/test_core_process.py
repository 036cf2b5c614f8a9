"""``engine_core="process"``: the engine loop in a child process behind the same LLM / AsyncLLM
classes. Greedy tokens equal HF transformers and the in-thread engine; aborts free the child's
blocks; a child that dies (killed, or its pipe gone) fails pending requests with EngineDeadError
within seconds and is reaped; a script that exits without closing leaves no engine process behind.

The first child costs the forkserver's imports (torch, transformers: seconds); later children fork
from it and load the tiny model at once, so the module builds one engine for the equality and
abort tests and one more for each failure test.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from transformers import LlamaConfig

from hearth_llm.engine import LLM, AsyncLLM, EngineDeadError, SamplingParams, get_engine

from conftest import TINY_COMMON, assert_pool_whole, random_prompts
from model_equality import GREEDY, check_alone_and_batched, check_prefix_hits, save_tiny_model

PROCESS = dict(engine_core="process", device="cpu", dtype="float32", show_progress=False)
LONG_RUN = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = LlamaConfig(**TINY_COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return save_tiny_model(config, tmp_path_factory.mktemp("core_process") / "llama", seed=7)


@pytest.fixture(scope="module")
def process_llm(model_dir):
    llm = LLM(str(model_dir), block_size=8, **PROCESS)
    yield llm
    llm.close()


def _shared(llm: LLM):
    def make(path, **kwargs):
        assert kwargs.get("block_size", 8) == 8, kwargs
        return llm
    return make


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """True once ``pid`` is reaped (not even a zombie answers signal 0)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_engine_runs_in_a_child_process_and_matches_hf_alone_batched_and_with_prefix_hits(model_dir,
                                                                                              process_llm):
    assert process_llm.engine.pid != os.getpid()
    check_alone_and_batched(model_dir, _shared(process_llm))
    check_prefix_hits(model_dir, _shared(process_llm))
    assert_pool_whole(process_llm.stats())


def test_tokens_equal_the_in_thread_engine(model_dir, process_llm):
    prompts = random_prompts(5, [3, 17, 40], seed=21)
    with LLM(str(model_dir), block_size=8, device="cpu", dtype="float32", show_progress=False) as in_thread:
        expected = [out.outputs[0].token_ids for out in in_thread.generate(prompts, GREEDY, use_tqdm=False)]
    assert [out.outputs[0].token_ids for out in process_llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_invalid_sampling_parameters_raise_on_the_callers_thread(process_llm):
    with pytest.raises(ValueError, match="temperature"):
        process_llm.generate([[5, 6]], SamplingParams(temperature=-1), use_tqdm=False)


def test_abort_by_id_and_a_reader_that_leaves_free_the_childs_blocks(model_dir, process_llm):
    core = get_engine(str(model_dir), block_size=8, **PROCESS)
    assert core is process_llm._core
    stream = core.add_request([5, 6, 7], LONG_RUN, request_id="to-abort")
    first = next(iter(stream))
    core.abort("to-abort")
    outputs = [first, *stream]
    assert outputs[-1].finish_reason == "abort" and len(outputs) < LONG_RUN.max_tokens

    async def leave_early() -> int:
        engine = AsyncLLM(str(model_dir), block_size=8, **PROCESS)
        try:
            async for output in engine.generate([8, 9, 10], LONG_RUN):
                return len(output.delta_token_ids)
        finally:
            engine.close()

    assert asyncio.run(leave_early()) >= 1
    deadline = time.monotonic() + 10
    while process_llm.stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert_pool_whole(process_llm.stats())


def _generate_in_background(llm: LLM, outcome: dict) -> threading.Thread:
    def generate():
        try:
            outcome["outputs"] = llm.generate(random_prompts(3, [5], seed=31), LONG_RUN, use_tqdm=False)
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            outcome["error"] = error

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 20
    while llm.stats().get("num_generation_tokens", 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.stats()["num_running"] > 0, "the requests should be mid-generation"
    return thread


@pytest.mark.parametrize("how", ["killed", "pipe closed"])
def test_a_dead_child_fails_pending_requests_with_engine_dead_promptly_and_is_reaped(model_dir, how):
    llm = LLM(str(model_dir), block_size=8, seed=1 if how == "killed" else 2, **PROCESS)  # its own engine
    pid, outcome = llm.engine.pid, {}
    thread = _generate_in_background(llm, outcome)
    died_at = time.monotonic()
    if how == "killed":
        os.kill(pid, signal.SIGKILL)
    else:  # as the child sees its parent die: its end of the pipe reads EOF
        llm._core._conn.close()
    thread.join(15)
    assert not thread.is_alive(), "generate() hung after the engine process died"
    assert isinstance(outcome.get("error"), EngineDeadError), outcome
    assert time.monotonic() - died_at < 5
    assert _gone(pid)
    with pytest.raises(EngineDeadError):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    llm.close()


def test_a_script_that_exits_without_closing_leaves_no_engine_process(model_dir):
    script = (f"from hearth_llm.engine import LLM, SamplingParams\n"
              f"llm = LLM({str(model_dir)!r}, **{PROCESS!r})\n"
              f"print(llm.engine.pid, flush=True)\n"
              f"llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    child_pid = int(done.stdout.split()[0])
    assert _gone(child_pid)


def test_lora_and_tensor_parallelism_are_refused_by_name(model_dir):
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(model_dir), enable_lora=True, **PROCESS)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(model_dir), tensor_parallel_size=2, **PROCESS)
    with pytest.raises(ValueError, match="engine_core"):
        LLM(str(model_dir), engine_core="fiber")
