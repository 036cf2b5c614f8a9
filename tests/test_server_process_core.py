"""The server over an engine core in its own process (``engine_core="process"``): what the engine
counts lives in the child's Prometheus registry, and ``/metrics`` shows it."""
from __future__ import annotations

import re

import httpx
import pytest

from hearth_llm.server import start_server

pytest.importorskip("prometheus_client")


def test_metrics_of_a_server_over_a_process_core_are_the_engine_processes(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    with start_server(model, embedding_model=None, served_model_name="tiny", engine_core="process",
                      dtype="float32", show_progress=False) as running:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{running.url}/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 5
        text = httpx.get(f"{running.root_url}/metrics", timeout=30).text
    # labelled with this model (other engines of the test session count in this process's registry)
    line = rf'^vllm:generation_tokens_total\{{model_name="{re.escape(model)}"\}} (\S+)$'
    counted = re.search(line, text, re.MULTILINE)
    assert counted is not None, text[:2000]
    assert float(counted.group(1)) >= 5


def test_the_engine_process_logs_where_its_parent_would(tiny_model_dirs, tmp_path):
    """A server over a process core shows the engine's log lines (load, sleep, periodic counters) as
    one over the thread core does: the child prints them at the level its parent shows."""
    import subprocess
    import sys

    script = tmp_path / "child_logs.py"
    script.write_text(
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from hearth_llm.engine import get_engine, SamplingParams\n"
        "core = get_engine(sys.argv[1], engine_core='process', dtype='float32', show_progress=False)\n"
        "core.attach(); core.wait_until_started()\n"
        "list(core.add_request([5, 6, 7], SamplingParams(max_tokens=2)))\n"
        "core.sleep(1)\n"
        "core.detach()\n")
    model = str(tiny_model_dirs["llama"])
    done = subprocess.run([sys.executable, str(script), model], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"the engine for {model!r} sleeps at level 1" in done.stderr
