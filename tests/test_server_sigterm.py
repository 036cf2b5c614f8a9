"""``hearth-llm serve`` as its own process, stopped with SIGTERM: a stream in flight that ends
within ``--drain-timeout`` gets its whole answer and ``[DONE]``; one still running at the deadline
is cut; the process then exits by itself."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from hearth_llm.benchmarks.serving import _health_ok, free_port

DRAIN_S = 0.3
LONG_TOKENS = 1000  # the tiny model's context is 1024; a few seconds of decoding on a CPU


def _stream(url: str, max_tokens: int, first_event: threading.Event, outcome: dict) -> None:
    body = {"model": "default", "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events = []
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    first_event.set()
    except httpx.HTTPError as error:  # a stream cut at the deadline ends mid-chunk
        outcome["error"] = type(error).__name__
    outcome["events"] = events
    first_event.set()


def test_sigterm_lets_a_short_stream_finish_cuts_a_long_one_at_the_deadline_and_exits(tiny_model_dirs):
    port = free_port()
    command = [sys.executable, "-m", "hearth_llm.cli", "serve", str(tiny_model_dirs["llama"]), "--port", str(port),
               "--embedding-model", "none", "--dtype", "float32", "--device", "cpu",
               "--drain-timeout", str(DRAIN_S)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while not _health_ok(port):
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/v1/completions"
        short, long = {}, {}
        started = [threading.Event(), threading.Event()]
        readers = [threading.Thread(target=_stream, args=(url, 16, started[0], short)),
                   threading.Thread(target=_stream, args=(url, LONG_TOKENS, started[1], long))]
        for reader in readers:
            reader.start()
        assert all(event.wait(60) for event in started)
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(60)
        status = server.wait(30)
        exited_after = time.monotonic() - signalled
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    assert short["events"][-1] == "[DONE]" and "error" not in short
    usage = json.loads(short["events"][-2])["usage"]
    assert usage["completion_tokens"] == 16  # the whole answer, though SIGTERM came after its first token
    assert long["events"] and long["events"][-1] != "[DONE]"  # cut at the drain deadline
    # uvicorn re-raises the signal it caught once it has shut down, so the status is SIGTERM's, as
    # for any process that the signal ended (a supervisor sees what stopped it)
    assert status in (0, -signal.SIGTERM)
    assert exited_after < DRAIN_S + 20
    print(f"long stream: {len(long['events'])} events before the cut; exited {exited_after:.2f} s after SIGTERM")
