"""``hearth-llm bench``: each benchmark is reachable from the command line with its own options.
The benchmarks themselves are scripts, not tests; only their help is read here."""
import subprocess
import sys

import pytest


def run_cli(*args: str) -> str:
    completed = subprocess.run([sys.executable, "-m", "hearth_llm.cli", *args], capture_output=True,
                               text=True, timeout=120, check=True)
    return completed.stdout


def test_bench_help_lists_every_benchmark():
    out = run_cli("bench", "--help")
    for name in ("throughput", "cpu", "embeddings", "langchain"):
        assert name in out


def test_bench_cpu_help_shows_the_cpu_benchmarks_options():
    out = run_cli("bench", "cpu", "--help")
    assert out.startswith("usage: hearth-llm bench cpu")
    assert "--skip-llama-cpp" in out and "--repeats" in out


@pytest.mark.parametrize("name, option", [("throughput", "--shape"), ("embeddings", "--num-sentences"),
                                          ("langchain", "--num-chats")])
def test_bench_forwards_help_to_each_benchmark(name, option):
    assert option in run_cli("bench", name, "--help")


def test_unknown_arguments_of_other_commands_are_still_refused():
    completed = subprocess.run([sys.executable, "-m", "hearth_llm.cli", "info", "--bogus"],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2 and "unrecognized arguments: --bogus" in completed.stderr
