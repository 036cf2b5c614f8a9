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


def test_the_callers_idle_team_ends_and_the_next_op_starts_a_new_one(two_threads):
    x = torch.randn(1 << 22)
    expected, team = _team_of_this_thread(x)
    assert len(team) == 1
    release_caller_threads()
    assert not team & _thread_ids()
    release_caller_threads()  # no team: nothing to do
    result, new_team = _team_of_this_thread(x)
    assert torch.equal(result, expected)
    assert len(new_team) == 1


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
def test_a_cpu_engine_ends_the_callers_team_when_it_is_handed_requests(tiny_model_dirs, make_llm, two_threads,
                                                                       release):
    from hearth_llm.engine import SamplingParams

    llm = make_llm(tiny_model_dirs["llama"], device="cpu", kv_cache_memory="16MiB", release_caller_threads=release)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # loaded
    _, team = _team_of_this_thread(torch.randn(1 << 22))  # this (the caller's) thread's torch work
    outputs = llm.generate([[5, 6, 8]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 2
    assert len(team) == 1
    assert (team & _thread_ids()) == (set() if release else team)


def test_release_caller_threads_must_be_a_bool():
    from hearth_llm.engine import EngineConfig

    with pytest.raises(ValueError, match="release_caller_threads"):
        EngineConfig(release_caller_threads="yes")
