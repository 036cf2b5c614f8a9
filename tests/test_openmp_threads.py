"""release_caller_threads ends the calling thread's idle OpenMP team and nobody else's; torch works on after it.

Threads are followed by id (/proc/self/task), so other tests' threads coming and going do not count."""
import os
import sys
import threading

import pytest
import torch

from hearth_llm.engine.openmp_threads import _loaded_libgomp, release_caller_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or _loaded_libgomp() is None,
                                reason="torch here does not run on libgomp")


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    release_caller_threads()  # start without a team of this thread's
    yield
    torch.set_num_threads(saved)


def _team_of_this_thread(x: torch.Tensor) -> tuple[torch.Tensor, set[int]]:
    """``x.exp()`` (a parallel region of 2 threads: this thread keeps an idle team of 1 after it) and
    the threads it started."""
    before = _thread_ids()
    result = x.exp()
    return result, _thread_ids() - before


_IN_A_FRESH_PROCESS = """
import os, torch
from hearth_llm.engine.openmp_threads import release_caller_threads

def thread_ids():
    return {int(tid) for tid in os.listdir("/proc/self/task")}

def team_of_this_thread(x):
    before = thread_ids()
    result = x.exp()
    return result, thread_ids() - before

torch.set_num_threads(2)
release_caller_threads()
"""


def _run_in_a_fresh_process(body: str) -> None:
    """Run ``body`` after the helpers above in a new interpreter. The main thread's OpenMP team is
    process-wide state: in the full suite earlier tests leave it in states these checks cannot reset
    (the CI dry run saw no new team thread at all), so the counting tests start from a clean process."""
    import subprocess
    import textwrap

    result = subprocess.run([sys.executable, "-c", _IN_A_FRESH_PROCESS + textwrap.dedent(body)],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_callers_idle_team_ends_and_the_next_op_starts_a_new_one():
    _run_in_a_fresh_process("""
        x = torch.randn(1 << 22)
        expected, team = team_of_this_thread(x)
        assert len(team) == 1, team
        release_caller_threads()
        assert not team & thread_ids()
        release_caller_threads()  # no team: nothing to do
        result, new_team = team_of_this_thread(x)
        assert torch.equal(result, expected)
        assert len(new_team) == 1, new_team
    """)


def test_another_threads_team_is_left_alone(two_threads):
    x = torch.randn(1 << 22)
    has_team, done = threading.Event(), threading.Event()
    teams = {}

    def engine_like() -> None:
        torch.set_num_threads(2)
        teams["engine"] = _team_of_this_thread(x)[1]
        has_team.set()
        done.wait(30)

    thread = threading.Thread(target=engine_like, daemon=True)
    thread.start()
    assert has_team.wait(30)
    _, own_team = _team_of_this_thread(x)
    release_caller_threads()
    alive = _thread_ids()
    assert not own_team & alive
    assert len(teams["engine"]) == 1 and teams["engine"] <= alive
    done.set()
    thread.join(30)


@pytest.mark.parametrize("release", [True, False])
def test_a_cpu_engine_ends_the_callers_team_when_it_is_handed_requests(tiny_model_dirs, release):
    _run_in_a_fresh_process(f"""
        from hearth_llm.engine import LLM, SamplingParams
        with LLM({str(tiny_model_dirs["llama"])!r}, device="cpu", kv_cache_memory="16MiB", show_progress=False,
                 release_caller_threads={release}) as llm:
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # loaded
            _, team = team_of_this_thread(torch.randn(1 << 22))  # this (the caller's) thread's torch work
            outputs = llm.generate([[5, 6, 8]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
            assert len(outputs[0].outputs[0].token_ids) == 2
            assert len(team) == 1, team
            assert (team & thread_ids()) == (set() if {release} else team)
    """)


def test_release_caller_threads_must_be_a_bool():
    from hearth_llm.engine import EngineConfig

    with pytest.raises(ValueError, match="release_caller_threads"):
        EngineConfig(release_caller_threads="yes")
