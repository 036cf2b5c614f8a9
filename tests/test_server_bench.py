"""``hearth-llm bench serving``'s client and measures, driven against an in-process server on a tiny
model (the benchmark itself runs servers in their own processes; see benchmarks/serving.py)."""
from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time

import pytest

from hearth_llm.benchmarks.serving import (RequestRecord, engine_options, http_sender, in_process_sender,
                                           llamacpp_command, main, measure, parse_args, process_group_cpu_seconds,
                                           stream_completion, summarize, workload)
from hearth_llm.engine import get_engine
from hearth_llm.server import start_server

ENGINE = {"dtype": "float32", "show_progress": False}
TINY_IDS = (4, 319)  # the tiny vocabulary's ordinary tokens


def test_the_bench_client_measures_every_request_over_http_and_in_process(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    requests = workload(6, (3, 12), (2, 5), token_ids=TINY_IDS)
    with start_server(model, embedding_model=None, served_model_name="bench", **ENGINE) as running:
        over_http = measure(http_sender(running.host, running.port), requests, [math.inf, 50.0], 0, TINY_IDS)
        in_process = measure(in_process_sender(get_engine(model, **ENGINE)), requests, [math.inf], 0, TINY_IDS)
    for result in (over_http["inf"], over_http["50"], in_process["inf"]):
        assert (result["num_completed"], result["num_failed"]) == (6, 0), result["first_errors"]
        assert result["output_tok_per_s"] > 0 and 0 < result["ttft_ms_p50"] <= result["ttft_ms_p99"]
        assert result["itl_ms_p50"] <= result["itl_ms_p99"] and result["tpot_ms_p50"] > 0


def test_a_request_short_of_its_max_tokens_or_failed_counts_as_failed():
    whole = RequestRecord(sent=0.0, token_times=[0.1, 0.2, 0.3], ended=0.3, num_output_tokens=3)
    short = RequestRecord(sent=0.0, token_times=[0.1], ended=0.2, num_output_tokens=1)
    failed = RequestRecord(sent=0.0, ended=0.1, error="HTTP 500: boom")
    summary = summarize([whole, short, failed], [3, 3, 3])
    assert (summary["num_completed"], summary["num_failed"]) == (1, 2)
    assert summary["first_errors"] == ["1 tokens, expected 3", "HTTP 500: boom"]
    assert summary["ttft_ms_p50"] == 100.0 and summary["tpot_ms_p50"] == 100.0
    assert summary["output_tok_per_s"] == 10.0  # 3 tokens over the run's 0.3 s


def test_a_stream_without_usage_that_ended_at_its_length_counts_its_max_tokens():
    # llama-cpp-python's server streams no usage: finish_reason "length" says max_tokens were generated
    at_length = RequestRecord(sent=0.0, token_times=[0.1, 0.2], ended=0.3, finish_reason="length")
    stopped = RequestRecord(sent=0.0, token_times=[0.1], ended=0.2, finish_reason="stop")
    summary = summarize([at_length, stopped], [5, 5])
    assert (summary["num_completed"], summary["num_failed"]) == (1, 1)
    assert at_length.num_output_tokens == 5 and summary["first_errors"] == ["0 tokens, expected 5"]


def test_the_client_reads_events_separated_by_crlf():
    events = (b'data: {"choices":[{"text":"a","finish_reason":null}]}\r\n\r\n'
              b'data: {"choices":[{"text":"b","finish_reason":"length"}]}\r\n\r\ndata: [DONE]\r\n\r\n')

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)  # the body: {}
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (events[:30], events[30:71], events[71:]):  # cuts inside a CRLF pair too
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def run() -> RequestRecord:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        record = RequestRecord()
        async with server:
            await stream_completion("127.0.0.1", server.sockets[0].getsockname()[1], {}, record)
        return record

    record = asyncio.run(run())
    assert record.error is None and len(record.token_times) == 2 and record.finish_reason == "length"


def test_show_prints_the_ratios_of_two_saved_runs(tmp_path, capsys):
    row = {"num_completed": 4, "num_failed": 0, "duration_s": 2.0, "request_throughput": 2.0, "ttft_ms_p50": 10.0,
           "ttft_ms_p99": 20.0, "itl_ms_p50": 1.0, "itl_ms_p99": 2.0, "tpot_ms_p50": 1.0, "tpot_ms_p99": 2.0}
    workload_fields = {"model": "qwen3-0.6b", "device": "cuda", "num_prompts": 4, "input_lengths": [1, 2],
                       "output_lengths": [1, 2]}
    saved = {"hearth-http-process": {"startup_s": 28.0, "inf": {**row, "output_tok_per_s": 150.0}},
             "vllm": {"startup_s": 70.0, "inf": {**row, "output_tok_per_s": 100.0, "ttft_ms_p99": 40.0}}}
    paths = []
    for name, result in saved.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({**workload_fields, "results": {name: result}}))
    main(["--show", *map(str, paths)])
    out = capsys.readouterr().out
    assert "rate inf: hearth-http-process / vllm: output tok/s x1.500, TTFT p99 x0.500" in out
    assert "| vllm | inf | 2 | 100 |" in out and "WARNING" not in out


def test_the_llamacpp_peer_needs_a_gguf_on_the_cpu():
    with pytest.raises(SystemExit):
        parse_args(["--shape", "qwen3-0.6b", "--peers", "llamacpp"])
    args = parse_args(["--peers", "llamacpp", "--num-threads", "2", "--max-model-len", "512"])
    command = llamacpp_command("/m.gguf", 1234, args)
    assert command[command.index("--n_threads") + 1] == "2" and command[command.index("--n_ctx") + 1] == "512"
    assert command[command.index("--interrupt_requests") + 1] == "false"
    assert engine_options(args)[1][-2:] == ["--num-threads", "2"]
    one_thread = llamacpp_command("/m.gguf", 1234, parse_args(["--peers", "llamacpp", "--num-threads", "2",
                                                               "--llamacpp-threads", "1"]))
    assert one_thread[one_thread.index("--n_threads") + 1] == "1"


def test_the_cpu_seconds_of_a_process_group_are_read_from_proc():
    # /proc's user + system times are the kernel's tick-sampled estimate, process_time() the exact
    # count: they can differ by a few ticks (CI read 0.29 for a 0.3 s spin), so the bounds leave room
    spin = "import time\nwhile time.process_time() < 0.5: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while process_group_cpu_seconds(child.pid).get("server", 0.0) < 0.4 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.2)
        assert 0.4 <= process_group_cpu_seconds(child.pid)["server"] < 2.0
    finally:
        child.kill()
        child.wait()
