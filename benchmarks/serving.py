"""Serving benchmark: streaming clients over HTTP against our OpenAI server and a peer, both given the
identical request list in the same run.

    hearth-llm bench serving                                   # CPU: the bundled model over HTTP vs in-process
    hearth-llm bench serving --shape qwen3-0.6b --peers vllm   # H200: ours vs `vllm serve`, random weights
    hearth-llm bench serving --shape tiny-qwen3 --device cpu --num-prompts 4 --input-lengths 8 16 \\
        --output-lengths 4 8 --rates inf    # a dry run of the whole path in seconds

Each request is ``POST /v1/completions`` with a token-id prompt, ``max_tokens``, ``ignore_eos``,
greedy and ``stream_options.include_usage``: fields both servers take, so neither renders a chat
template the other does not, and every request generates exactly ``max_tokens``. Requests arrive
as a Poisson process at each ``--rates`` value (``inf``: all at once), from one seed, so every
server sees the same prompts at the same offsets. Measured per request: TTFT (send to first token
event), ITL (gaps between token events), TPOT ((end - first token) / (tokens - 1)); per run:
requests/s and output tokens/s from the first send to the last answer.

Servers run in their own processes (``hearth-llm serve``, ``vllm serve``),
one after the other, so they never share the device. The peers:

- ``in-process``: the same engine driven from this process through ``EngineCore.add_request`` with the
  same requests and arrivals: the difference is what HTTP, JSON and SSE cost per request and token;
- ``vllm``: ``vllm serve`` on the same checkpoint directory with ``--load-format dummy`` (its weights
  random too; only shape and speed matter here), started with ``--vllm-pythonpath`` (default
  /tmp/vsite, where the vLLM bundle unpacks on the H200) as its only ``PYTHONPATH``.

``--shape`` writes a random-weight checkpoint of a real shape (:mod:`.random_weights`; safetensors,
config.json and a word-level tokenizer of the vocabulary, so both servers detokenize) to a
temporary directory; without it ``--model`` is served (``default``: the bundled SmolLM2-135M).

The HTTP client is asyncio streams, not an HTTP library: it costs the same for every server, parses
only what it must, and needs no package the GPU image may lack.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SERVED_NAME = "bench"
TOKEN_ID_RANGE = (0, 10000)  # as bench throughput's workload; every shape's vocabulary covers it


# ---- the workload -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    prompt_text: str | None = None  # sent instead of the ids when set (a server that takes only text)

    def body(self, model: str = SERVED_NAME) -> dict:
        """The ``/v1/completions`` body, the same for every server."""
        prompt = self.prompt_token_ids if self.prompt_text is None else self.prompt_text
        return {"model": model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def workload(num_prompts: int, input_lengths: tuple[int, int], output_lengths: tuple[int, int],
             seed: int = 0, token_ids: tuple[int, int] = TOKEN_ID_RANGE) -> list[BenchRequest]:
    """Random token-id prompts; with both length ranges (100, 1024) and seed 0 the same requests as
    ``bench throughput``'s workload.

    >>> [len(r.prompt_token_ids) for r in workload(2, (4, 8), (1, 3))]
    [7, 6]
    """
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        prompt = [rng.randint(*token_ids) for _ in range(rng.randint(*input_lengths))]
        requests.append(BenchRequest(prompt, rng.randint(*output_lengths)))
    return requests


def shifted(requests: list[BenchRequest], shift: int,
            token_ids: tuple[int, int] = TOKEN_ID_RANGE) -> list[BenchRequest]:
    """The same lengths with other token ids (each id + ``shift``, wrapped in the id range).

    >>> shifted([BenchRequest([0, 10000], 2)], 1)[0].prompt_token_ids
    [1, 0]
    """
    low, high = token_ids
    return [BenchRequest([low + (t - low + shift) % (high - low + 1) for t in r.prompt_token_ids], r.max_tokens)
            for r in requests]


def arrival_offsets(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of ``rate``
    requests/s (exponential gaps), or all at once for ``inf``.

    >>> arrival_offsets(3, math.inf)
    [0.0, 0.0, 0.0]
    """
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


# ---- what one request measured ------------------------------------------------------------------

@dataclass(slots=True)
class RequestRecord:
    """One request's timeline: when it was sent, when each token event arrived, when it ended."""

    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    ended: float = 0.0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default).

    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5)
    2.5
    """
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(records: list[RequestRecord], expected_tokens: list[int]) -> dict:
    """Throughput and latency percentiles (ms) of one run; a request that failed or came back with
    other than its ``max_tokens`` counts as failed. A stream without ``usage`` (llama-cpp-python's
    server sends none) that ended with ``finish_reason: "length"`` generated its ``max_tokens``."""
    for record, num_expected in zip(records, expected_tokens):
        if not record.num_output_tokens and record.finish_reason == "length" and record.error is None:
            record.num_output_tokens = num_expected
    done = [r for r, n in zip(records, expected_tokens)
            if r.error is None and r.num_output_tokens == n and r.token_times]
    failed = [r.error or f"{r.num_output_tokens} tokens, expected {n}" for r, n in zip(records, expected_tokens)
              if r not in done]
    started = min(r.sent for r in records)
    duration = max(r.ended for r in records) - started
    itls = [gap for r in done for gap in r.itls]
    tpots = [r.tpot for r in done if r.tpot is not None]
    ms = 1000.0
    return {"num_completed": len(done), "num_failed": len(failed), "first_errors": failed[:3],
            "duration_s": round(duration, 3),
            "request_throughput": round(len(done) / duration, 3),
            "output_tok_per_s": round(sum(r.num_output_tokens for r in done) / duration, 1),
            "ttft_ms_p50": round(percentile([r.ttft for r in done], 0.5) * ms, 2),
            "ttft_ms_p99": round(percentile([r.ttft for r in done], 0.99) * ms, 2),
            "itl_ms_p50": round(percentile(itls, 0.5) * ms, 2), "itl_ms_p99": round(percentile(itls, 0.99) * ms, 2),
            "tpot_ms_p50": round(percentile(tpots, 0.5) * ms, 2),
            "tpot_ms_p99": round(percentile(tpots, 0.99) * ms, 2)}


# ---- the HTTP client: one connection per request, SSE over chunked transfer ---------------------

async def stream_completion(host: str, port: int, body: dict, record: RequestRecord) -> None:
    """POST ``body`` to ``/v1/completions`` and fill ``record`` from its event stream."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port, limit=2**22)
    try:
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                     .encode() + payload)
        await writer.drain()
        status, headers = await _read_head(reader)
        chunks = _chunked(reader) if headers.get("transfer-encoding") == "chunked" else _to_end(reader)
        if status != 200:
            record.error = f"HTTP {status}: {b''.join([c async for c in chunks])[:300].decode(errors='replace')}"
            return
        buffer = b""
        async for chunk in chunks:
            now = time.perf_counter()
            buffer += chunk
            if b"\r" in buffer:  # events separated by CRLF (sse-starlette's, llama-cpp-python's server)
                buffer = buffer.replace(b"\r\n", b"\n")
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if _read_event(event, now, record):
                    return
        record.error = record.error or "the stream ended without [DONE]"
    finally:
        record.ended = time.perf_counter()
        writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    return status, headers


async def _chunked(reader: asyncio.StreamReader):
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            return
        yield (await reader.readexactly(size + 2))[:-2]


async def _to_end(reader: asyncio.StreamReader):
    while chunk := await reader.read(65536):
        yield chunk


def _read_event(event: bytes, now: float, record: RequestRecord) -> bool:
    """Apply one SSE event to ``record``; True at ``[DONE]``."""
    data = event.strip()
    if not data.startswith(b"data:"):
        return False
    data = data[5:].strip()
    if data == b"[DONE]":
        return True
    chunk = json.loads(data)
    if "error" in chunk:
        record.error = str(chunk["error"].get("message"))[:300]
    choices = chunk.get("choices") or ()
    if any(choice.get("text") for choice in choices):
        record.token_times.append(now)
    for choice in choices:
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    if chunk.get("usage"):
        record.num_output_tokens = chunk["usage"]["completion_tokens"]
    return False


# ---- one run: the requests at their offsets, over HTTP or in-process ----------------------------

async def run_requests(send, requests: list[BenchRequest], offsets: list[float]) -> list[RequestRecord]:
    """``await send(request, record)`` for each request at its offset; every record, filled."""
    records = [RequestRecord() for _ in requests]
    start = time.perf_counter()

    async def one(request: BenchRequest, record: RequestRecord, offset: float) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        record.sent = time.perf_counter()
        try:
            await send(request, record)
        except Exception as error:  # noqa: BLE001 - a failed request is a result, not the end of the run
            record.error = f"{type(error).__name__}: {error}"
            record.ended = record.ended or time.perf_counter()

    await asyncio.gather(*(one(r, rec, o) for r, rec, o in zip(requests, records, offsets)))
    return records


def http_sender(host: str, port: int, body=BenchRequest.body):
    """Sends each request as ``body(request)`` (default: :meth:`BenchRequest.body`)."""
    async def send(request: BenchRequest, record: RequestRecord) -> None:
        await stream_completion(host, port, body(request), record)
    return send


def in_process_sender(core):
    """The same request straight onto ``core`` (an ``EngineCore``), read as the server reads it."""
    from hearth_llm.engine import SamplingParams

    async def send(request: BenchRequest, record: RequestRecord) -> None:
        params = SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True)
        prompt = request.prompt_token_ids if request.prompt_text is None else request.prompt_text
        stream = core.add_request(prompt, params)
        try:
            async for output in stream:
                if output.delta_token_ids:
                    record.token_times.append(time.perf_counter())
                    record.num_output_tokens += len(output.delta_token_ids)
        finally:
            stream.close()
            record.ended = time.perf_counter()
    return send


async def warm_up(send, input_lengths: tuple[int, int], token_ids: tuple[int, int] = TOKEN_ID_RANGE,
                  to_text=None) -> None:
    """Batches of 1, 16 and 17 requests of 4 tokens (as bench throughput's warm-up: every kernel
    specialization the runs meet is compiled before them) on other prompts of the runs' lengths."""
    for count in (1, 16, 17):
        requests = as_text(workload(count, input_lengths, (4, 4), seed=1000 + count, token_ids=token_ids), to_text)
        records = await run_requests(send, requests, [0.0] * count)
        errors = [r.error for r in records if r.error]
        if errors:
            raise RuntimeError(f"warm-up failed: {errors[0]}")


def measure(send, requests: list[BenchRequest], rates: list[float], seed: int,
            token_ids: tuple[int, int] = TOKEN_ID_RANGE, cpu_seconds=None, to_text=None) -> dict[str, dict]:
    """Warm up, then ``requests`` at each rate (Poisson arrivals from ``seed``); a summary per rate.
    ``cpu_seconds()``, if given, says the CPU seconds each of the server's processes has used so
    far (``{name: seconds}``): each rate's summary then has the run's share as ``cpu_s``, with the
    client's own as ``client``. ``to_text(ids)``, if given, turns every prompt into text first."""
    async def run() -> dict[str, dict]:
        low, high = min(len(r.prompt_token_ids) for r in requests), max(len(r.prompt_token_ids) for r in requests)
        await warm_up(send, (low, high), token_ids, to_text)
        results = {}
        for index, rate in enumerate(rates):
            # other token ids per rate: no run reads the prefix cache an earlier one filled
            run = as_text(shifted(requests, index, token_ids) if index else requests, to_text)
            before = _cpu_snapshot(cpu_seconds)
            records = await run_requests(send, run, arrival_offsets(len(requests), rate, seed))
            results[_rate_name(rate)] = summarize(records, [r.max_tokens for r in requests])
            if cpu_seconds is not None:
                after = _cpu_snapshot(cpu_seconds)
                results[_rate_name(rate)]["cpu_s"] = {name: round(after[name] - before.get(name, 0.0), 3)
                                                      for name in after}
            print(json.dumps({"rate": _rate_name(rate), **results[_rate_name(rate)]}), flush=True)
        return results
    return asyncio.run(run())


def as_text(requests: list[BenchRequest], to_text) -> list[BenchRequest]:
    """``requests`` with ``prompt_text = to_text(prompt_token_ids)`` (unchanged without ``to_text``)."""
    if to_text is None:
        return requests
    return [BenchRequest(r.prompt_token_ids, r.max_tokens, to_text(r.prompt_token_ids)) for r in requests]


def _rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _cpu_snapshot(cpu_seconds) -> dict[str, float]:
    if cpu_seconds is None:
        return {}
    return {**cpu_seconds(), "client": time.process_time()}


def process_group_cpu_seconds(group_id: int) -> dict[str, float]:
    """CPU seconds (user + system) of every live process in process group ``group_id``, from
    /proc: the group's leader as ``server``, the others summed by their command name (vLLM's
    ``VLLM::EngineCore``, our engine child's ``python``...); empty where /proc is not there. A
    process that ended is missing (its seconds with it)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()  # from field 3 (state) on
        if int(fields[2]) != group_id:  # field 5: the process group
            continue
        role = "server" if int(entry.name) == group_id else f"child:{name}"
        seconds[role] = seconds.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / ticks  # fields 14, 15
    return seconds


# ---- server processes -----------------------------------------------------------------------------

class ServerProcess:
    """A server in its own process group (vLLM starts children), logging to a file, stopped with
    SIGINT then SIGKILL."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, log_dir: Path,
                 ready_path: str = "/health"):
        self.name = name
        self.port = port
        self.ready_path = ready_path  # answers 200 once the server can take requests
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        started = time.perf_counter()
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.started = started
        self.dumps_stacks = env.get("PYTHONFAULTHANDLER") == "1"

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``GET /health`` answered 200; RuntimeError (with the log's tail) otherwise."""
        deadline = time.perf_counter() + timeout
        next_report = time.perf_counter() + 15.0
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if _health_ok(self.port, self.ready_path):
                return time.perf_counter() - self.started
            if time.perf_counter() >= next_report:  # a slow start (vLLM's compile) shows where it is
                last = (self.log_tail(1) or "").strip()[:160]
                print(f"{self.name}: starting, {time.perf_counter() - self.started:.0f} s; log: {last}", flush=True)
                next_report += 15.0
            time.sleep(0.5)
        if self.dumps_stacks:
            self.dump_stacks()
        raise RuntimeError(f"{self.name} did not answer /health within {timeout:.0f} s:\n{self.log_tail(150)}")

    def dump_stacks(self) -> None:
        """Every process of the server's group writes its threads' stacks to the log and ends
        (SIGABRT; the group runs with PYTHONFAULTHANDLER=1): where a start that hangs waits."""
        try:
            os.killpg(self.process.pid, signal.SIGABRT)
            self.process.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        time.sleep(1.0)  # the group's other processes write theirs too

    def log_tail(self, num_lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self) -> None:
        if self.process.poll() is None or self.dumps_stacks:  # (also its forkserver, after a dump)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._log.close()


def _health_ok(port: int, path: str = "/health") -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            return sock.recv(64).split(b" ", 2)[1] == b"200"
    except (OSError, IndexError):
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ours_name(engine_core: str | None) -> str:
    """``hearth-http`` (``hearth-llm serve`` as it runs by default: the process core on CUDA, the thread
    core on the CPU; or ``--engine-core thread``), ``hearth-http-process``, ``hearth-http-si0.5ms`` (the
    thread core with ``--switch-interval 0.0005``)."""
    core, _, interval = (engine_core or "thread").partition("@")
    name = "hearth-http" if core == "thread" else f"hearth-http-{core}"
    return name + (f"-si{float(interval) * 1000:g}ms" if interval else "")


def ours_flags(engine_core: str | None) -> list[str]:
    """``hearth-llm serve`` flags of an ``--engine-core`` value (none: the server's default)."""
    if engine_core is None:
        return []
    core, _, interval = engine_core.partition("@")
    return ["--engine-core", core] + (["--switch-interval", interval] if interval else [])


def ours_command(model: str, port: int, engine_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "hearth_llm.cli", "serve", model, "--port", str(port), "--served-model-name",
            SERVED_NAME, "--embedding-model", "none", *engine_args]


# `vllm serve` as its console script runs it (vllm.entrypoints.cli.main:main), without needing the script
_VLLM_SERVE = "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"


def vllm_command(model_dir: str, port: int, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-c", _VLLM_SERVE, "serve", model_dir, "--port", str(port),
            "--served-model-name", SERVED_NAME, "--load-format", "dummy", "--dtype", args.dtype or "auto",
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", "0.85", "--seed", "0",
            "--uvicorn-log-level", "warning"]


def measure_server(server: ServerProcess, args, requests, body=BenchRequest.body, to_text=None) -> dict:
    """Wait for ``server`` to answer, run the requests at every rate against it (each sent as
    ``body(request)``), stop it."""
    try:
        startup_s = server.wait_ready(args.startup_timeout)
        print(f"{server.name}: ready after {startup_s:.1f} s", flush=True)
        cpu_seconds = lambda: process_group_cpu_seconds(server.process.pid)  # noqa: E731 - its own group
        return {"startup_s": round(startup_s, 1), **measure(http_sender("127.0.0.1", server.port, body), requests,
                                                            args.rates, args.seed, cpu_seconds=cpu_seconds,
                                                            to_text=to_text)}
    except Exception as error:  # noqa: BLE001 - the other servers still run; the table says what failed
        print(f"{server.name}: FAILED: {error}", flush=True)
        return {"error": str(error)[-2000:]}
    finally:
        server.stop()


def measure_in_process(model: str, engine_kwargs: dict, requests, args, to_text=None) -> dict:
    from hearth_llm.engine import get_engine

    core = get_engine(model, show_progress=False, **engine_kwargs)
    core.attach()
    try:
        core.wait_until_started()
        return measure(in_process_sender(core), requests, args.rates, args.seed, to_text=to_text)
    finally:
        core.detach()


# ---- llama.cpp's server (llama-cpp-python's), the CPU peer -------------------------------------------

def llamacpp_command(gguf_path: str, port: int, args: argparse.Namespace) -> list[str]:
    """``python -m llama_cpp.server`` from ``--llamacpp-python`` on the same GGUF file. Its lock
    serves one request at a time (no batching); ``interrupt_requests`` off, so a request that
    arrives waits instead of cutting the running one short (that server's default)."""
    threads = str(args.llamacpp_threads or args.num_threads)
    return [args.llamacpp_python, "-m", "llama_cpp.server", "--model", gguf_path, "--host", "127.0.0.1",
            "--port", str(port), "--model_alias", SERVED_NAME, "--n_threads", threads, "--n_threads_batch", threads,
            "--n_ctx", str(args.max_model_len or 2048), "--interrupt_requests", "false", "--verbose", "false"]


def gguf_control_token_ids(gguf_path: str) -> list[int]:
    """The GGUF vocabulary's control tokens (EOS, the chat markers): every token llama.cpp may end
    a generation at."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[index][0]) for index in field.data]
    return [token_id for token_id, kind in enumerate(types) if kind == gguf.TokenType.CONTROL]


def llamacpp_body(gguf_path: str):
    """The body for llama-cpp-python's server: no ``ignore_eos`` there, so every control token is
    biased away instead (``logit_bias``, -100); it takes text prompts only (see ``text_prompts``)."""
    bias = {str(token_id): -100.0 for token_id in gguf_control_token_ids(gguf_path)}

    def body(request: BenchRequest) -> dict:
        return {**request.body(), "logit_bias": bias}
    return body


def text_prompts(model: str):
    """``ids -> text`` with the model's tokenizer (special tokens dropped: ours and llama.cpp's
    would read those differently), for a run where every server gets the same text prompts."""
    import torch

    from hearth_llm.engine.loader import load_checkpoint

    tokenizer = load_checkpoint(model, torch.float32, progress=False).tokenizer
    return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=True)


def resolved_model_path(model: str) -> str:
    """``default`` as the bundled GGUF's path (what llama.cpp's server needs), else ``model``."""
    if model == "default":
        from hearth_llm.engine.loader import default_model_path

        return str(default_model_path())
    return model


# ---- the checkpoint --------------------------------------------------------------------------------

def write_random_model(shape: str, directory: Path, dtype_name: str = "bfloat16", weights: bool = True) -> Path:
    """A checkpoint directory of ``shape`` (bench throughput's SHAPES) as a hub checkpoint is laid
    out: config.json, safetensors shards, a word-level tokenizer. The weights are random values
    written fast (:mod:`.checkpoint_writer`: 16 GB for the 8B shape in seconds, every byte written);
    ``weights=False`` leaves them out (enough for ``vllm serve --load-format dummy``)."""
    from .checkpoint_writer import write_random_checkpoint
    from .throughput import hf_config, placeholder_tokenizer

    if weights:
        write_random_checkpoint(shape, directory, dtype_name)
        return directory
    config = hf_config(shape)
    config.dtype = dtype_name
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    placeholder_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory


# ---- the table ----------------------------------------------------------------------------------------

_COLUMNS = [("req/s", "request_throughput"), ("out tok/s", "output_tok_per_s"), ("TTFT p50", "ttft_ms_p50"),
            ("TTFT p99", "ttft_ms_p99"), ("ITL p50", "itl_ms_p50"), ("ITL p99", "itl_ms_p99"),
            ("TPOT p50", "tpot_ms_p50"), ("TPOT p99", "tpot_ms_p99"), ("ok/fail", None)]


def table(results: dict[str, dict], rates: list[float]) -> str:
    """Markdown: one row per server and rate (latencies in ms)."""
    lines = ["| server | rate | " + " | ".join(name for name, _ in _COLUMNS) + " |",
             "|---" * (len(_COLUMNS) + 2) + "|"]
    for server, result in results.items():
        if "error" in result:
            lines.append(f"| {server} | — | FAILED: {result['error'].splitlines()[0][:100]} |")
            continue
        for rate in map(_rate_name, rates):
            row = result.get(rate)
            if row is None:
                continue
            cells = [f"{row['num_completed']}/{row['num_failed']}" if key is None else f"{row[key]:g}"
                     for _, key in _COLUMNS]
            lines.append(f"| {server} | {rate} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(results: dict[str, dict], rates: list[float]) -> list[str]:
    """Ours against each peer: throughput ratio (> 1: ours faster) and p99 TTFT ratio (< 1: ours lower)."""
    lines = []
    for name, ours in results.items():
        if not name.startswith("hearth-http") or "error" in ours:
            continue
        for peer, result in results.items():
            if peer.startswith("hearth-http") or "error" in result:
                continue
            for rate in map(_rate_name, rates):
                if rate in ours and rate in result and result[rate]["output_tok_per_s"] and result[rate]["ttft_ms_p99"]:
                    lines.append(f"rate {rate}: {name} / {peer}: output tok/s x"
                                 f"{ours[rate]['output_tok_per_s'] / result[rate]['output_tok_per_s']:.3f}, "
                                 f"TTFT p99 x{ours[rate]['ttft_ms_p99'] / result[rate]['ttft_ms_p99']:.3f}")
    return lines


def cpu_lines(results: dict[str, dict]) -> list[str]:
    """Per server and rate: each of its processes' CPU time per output token (us), and the client's."""
    lines = []
    for server, result in results.items():
        for rate, row in result.items():
            if not isinstance(row, dict) or not row.get("cpu_s"):
                continue
            num_tokens = row["output_tok_per_s"] * row["duration_s"]
            if num_tokens:
                shares = ", ".join(f"{name} {1e6 * seconds / num_tokens:.0f}" for name, seconds in row["cpu_s"].items())
                lines.append(f"{server} rate {rate}: CPU us per output token: {shares}")
    return lines


# ---- main ------------------------------------------------------------------------------------------------

def _rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 requests/s or 'inf', got {text!r}")
    return rate


def _engine_core(text: str) -> str:
    core, has_interval, interval = text.partition("@")
    if core not in ("thread", "process"):
        raise argparse.ArgumentTypeError(f"an engine core is 'thread' or 'process' (optionally @SECONDS), got {text!r}")
    if has_interval and not _is_positive_number(interval):
        raise argparse.ArgumentTypeError(f"the switch interval after '@' must be > 0 seconds, got {text!r}")
    return text


def _is_positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _lengths(parser, name: str, values) -> tuple[int, int]:
    low, high = values
    if not 1 <= low <= high:
        parser.error(f"{name} {low} {high}: need 1 <= LOW <= HIGH")
    return low, high


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="what our server serves when --shape is not given")
    parser.add_argument("--shape", default=None, help="a random-weight checkpoint of this shape (bench throughput's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda with --shape, else cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, the engine's choice on cpu")
    parser.add_argument("--engine-core", type=_engine_core, nargs="+", default=None, metavar="CORE[@SECONDS]",
                        help="our server's engine loop: 'thread' (of the server process, the default) or 'process' "
                             "(its own); '@SECONDS' adds that --switch-interval (thread@0.0005); several: one "
                             "server each, measured one after the other")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="our server's sys.setswitchinterval (hearth-llm serve --switch-interval)")
    parser.add_argument("--no-ours", action="store_true",
                        help="measure only the peers (our server's runs done in another call, e.g. another "
                             "device lease of the same machine kind)")
    parser.add_argument("--peers", default=None,
                        help="comma-separated: in-process, vllm, llamacpp (llama-cpp-python's server, on the CPU, "
                             "a GGUF model), or none (default: in-process on cpu, vllm on cuda)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 128 on cuda, 16 on cpu")
    parser.add_argument("--input-lengths", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"),
                        help="prompt lengths uniform in [LOW, HIGH] (default 100 1024 on cuda, 32 128 on cpu)")
    parser.add_argument("--output-lengths", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"),
                        help="max_tokens uniform in [LOW, HIGH] (default 100 1024 on cuda, 16 64 on cpu)")
    parser.add_argument("--rates", type=_rate, nargs="+", default=None,
                        help="requests/s of the Poisson arrivals, one run each; 'inf': all at once "
                             "(default 16 64 inf on cuda, 2 inf on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default 256 on cuda, the engine's on cpu")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default 16384 on cuda, the engine's on cpu")
    parser.add_argument("--max-model-len", type=int, default=None, help="default 4096 on cuda, the model's on cpu")
    parser.add_argument("--kv-cache-memory", default=None, help="ours; default 40GiB on cuda, the engine's on cpu")
    parser.add_argument("--startup-timeout", type=float, default=180.0, help="seconds each server may take to start")
    parser.add_argument("--vllm-pythonpath", default="/tmp/vsite", help="the vLLM server's only PYTHONPATH")
    parser.add_argument("--llamacpp-python", default="/tmp/llamacpp-venv/bin/python",
                        help="the interpreter with llama-cpp-python[server] installed (the llamacpp peer)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="CPU threads of every server's engine: ours (--num-threads) and llama.cpp's "
                             "(--n_threads, --n_threads_batch); default: ours its engine's, llama.cpp's the cores "
                             "this process may use")
    parser.add_argument("--llamacpp-threads", type=int, default=None,
                        help="llama.cpp's threads when not --num-threads: on a contended 2-core machine its "
                             "spinning thread pool can run several times slower on 2 threads than on 1")
    parser.add_argument("--server-pythonpath", default=None,
                        help="appended to our server's PYTHONPATH (on the H200: /tmp/vsite, for fastapi/uvicorn)")
    parser.add_argument("--start-together", action="store_true",
                        help="start every one of our servers (--engine-core ...) at once, then measure them one "
                             "after the other: the starts overlap (they share the device; mind --kv-cache-memory)")
    parser.add_argument("--log-dir", default=None, help="keep each server's log here (default: a temporary directory)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--compare", default=None, metavar="JSON",
                        help="also show (table, ratios) the servers of an earlier run's --json with the same workload")
    parser.add_argument("--show", nargs="+", default=None, metavar="JSON",
                        help="run nothing: the table and ratios of these --json files (e.g. two calls of one lease)")
    args = parser.parse_args(argv)
    on_gpu = (args.device or ("cuda" if args.shape else "cpu")) == "cuda"
    args.device = "cuda" if on_gpu else "cpu"
    args.dtype = args.dtype or ("bfloat16" if on_gpu else None)
    peers = args.peers or ("vllm" if on_gpu else "in-process")
    args.peers = [] if peers == "none" else [p for p in peers.split(",") if p]
    unknown = set(args.peers) - {"in-process", "vllm", "llamacpp"}
    if unknown:
        parser.error(f"--peers: unknown {sorted(unknown)}; known: in-process, vllm, llamacpp")
    if "llamacpp" in args.peers and (on_gpu or not (args.model == "default" or args.model.endswith(".gguf"))):
        parser.error("--peers llamacpp runs on the CPU on a GGUF file: --model default (the bundled SmolLM2 "
                     "Q4_1) or --model FILE.gguf, without --shape")
    if "vllm" in args.peers and not (args.shape or os.path.isdir(args.model)):
        parser.error("--peers vllm needs --shape or --model DIR (vLLM serves a checkpoint directory, "
                     "with dummy weights)")
    if args.no_ours and not args.peers:
        parser.error("--no-ours needs --peers: there would be nothing to measure")
    args.num_prompts = args.num_prompts or (128 if on_gpu else 16)
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    args.input_lengths = _lengths(parser, "--input-lengths",
                                  args.input_lengths or ((100, 1024) if on_gpu else (32, 128)))
    args.output_lengths = _lengths(parser, "--output-lengths",
                                   args.output_lengths or ((100, 1024) if on_gpu else (16, 64)))
    args.rates = args.rates or ([16.0, 64.0, math.inf] if on_gpu else [2.0, math.inf])
    if on_gpu:  # bench throughput's settings, for both servers
        args.max_num_seqs = args.max_num_seqs or 256
        args.max_num_batched_tokens = args.max_num_batched_tokens or 16384
        args.max_model_len = args.max_model_len or 4096
        args.kv_cache_memory = args.kv_cache_memory or "40GiB"
    return args


def engine_options(args) -> tuple[dict, list[str]]:
    """Our engine's settings, as EngineConfig fields and as ``hearth-llm serve`` flags."""
    kwargs = {"device": args.device}
    for name in ("dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory", "num_threads"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    flags = [item for name, value in kwargs.items() for item in (f"--{name.replace('_', '-')}", str(value))]
    if args.switch_interval is not None:  # a server option, not an engine one
        flags += ["--switch-interval", str(args.switch_interval)]
    return kwargs, flags


def scheduler_settings(args) -> dict:
    """The limits both sides ran under (None: that engine's default), for the report."""
    return {name: getattr(args, name) for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                                   "num_threads")}


def _earlier_results(path: str | None, report: dict) -> dict[str, dict]:
    """The servers of an earlier run's ``--json`` (another call of the same lease), if it ran the
    same workload; else nothing, and a line saying why."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as source:
        earlier = json.load(source)
    same = ("model", "device", "num_prompts", "input_lengths", "output_lengths")
    if any(json.loads(json.dumps(earlier.get(key))) != json.loads(json.dumps(report[key])) for key in same):
        print(f"--compare {path}: another workload ({ {key: earlier.get(key) for key in same} }); not shown")
        return {}
    return {name: result for name, result in earlier["results"].items() if name not in report["results"]}


def show(paths: list[str]) -> None:
    """The table and ratios of saved ``--json`` reports (the servers of each; a later file's server
    of the same name wins), warning when their workloads differ."""
    reports = []
    for path in paths:
        with open(path) as source:
            reports.append(json.load(source))
    same = ("model", "device", "num_prompts", "input_lengths", "output_lengths")
    for path, report in zip(paths[1:], reports[1:]):
        if any(report.get(key) != reports[0].get(key) for key in same):
            print(f"WARNING: {path} ran another workload than {paths[0]}: "
                  f"{ {key: (reports[0].get(key), report.get(key)) for key in same} }")
    results = {name: result for report in reports for name, result in report["results"].items()}
    rates = sorted({rate for result in results.values() if "error" not in result
                    for rate, row in result.items() if isinstance(row, dict)}, key=float)
    print(table(results, [float(rate) for rate in rates]))
    for line in ratios(results, [float(rate) for rate in rates]) + cpu_lines(results):
        print(line)
    for path, report in zip(paths, reports):
        print(f"{path}: {report.get('model')} on {report.get('device')}, {report.get('num_prompts')} requests per "
              f"rate, load average {report.get('load_average')}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.show:
        show(args.show)
        return
    # `timeout` sends SIGTERM: leave through the finally blocks, which stop the servers (their own
    # process groups would outlive us and hold the device)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work_dir = Path(tempfile.mkdtemp(prefix="hearth-serving-"))
    results: dict[str, dict] = {}
    started: dict[str, ServerProcess] = {}

    def save() -> None:  # after every server: a run cut short by its time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as sink:
                json.dump(report_of(args, results), sink, indent=2, default=str)

    try:
        model = args.model
        if args.shape:
            began = time.perf_counter()
            has_weights = not args.no_ours or "in-process" in args.peers  # vLLM's dummy load needs none
            model = str(write_random_model(args.shape, work_dir / args.shape, args.dtype or "float32", has_weights))
            print(f"wrote a random {args.shape} checkpoint in {time.perf_counter() - began:.1f} s", flush=True)
        requests = workload(args.num_prompts, args.input_lengths, args.output_lengths, args.seed)
        # llama-cpp-python's server takes text prompts only: then every server gets the same text
        to_text = text_prompts(model) if "llamacpp" in args.peers else None
        if "llamacpp" in args.peers and args.num_threads is None:
            args.num_threads = len(os.sched_getaffinity(0))  # both sides on the same cores
        engine_kwargs, engine_flags = engine_options(args)
        env = dict(os.environ)
        if args.server_pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), args.server_pythonpath) if p)
        log_dir = Path(args.log_dir) if args.log_dir else work_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        if not args.no_ours:
            env["PYTHONFAULTHANDLER"] = "1"  # a start that hangs is asked where it is (see ServerProcess.dump_stacks)
            ours = []  # (name, command, port) per engine core
            for core in args.engine_core or [None]:
                port = free_port()
                ours.append((ours_name(core), ours_command(model, port, engine_flags + ours_flags(core)), port))
            if args.start_together:  # the starts overlap; the runs still come one after the other
                started = {name: ServerProcess(name, command, env, port, log_dir) for name, command, port in ours}
                for server in started.values():  # all up before the first run: no start overlaps a run
                    with contextlib.suppress(RuntimeError):  # (measure_server reports it)
                        server.wait_ready(args.startup_timeout)
            for name, command, port in ours:
                server = started.get(name) or ServerProcess(name, command, env, port, log_dir)
                results[name] = measure_server(server, args, requests, to_text=to_text)
                save()
        if "vllm" in args.peers:
            vllm_env = {**os.environ, "PYTHONPATH": args.vllm_pythonpath, "VLLM_USE_FLASHINFER_SAMPLER": "0",
                        "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
            port = free_port()
            server = ServerProcess("vllm", vllm_command(model, port, args), vllm_env, port, log_dir)
            results["vllm"] = measure_server(server, args, requests)
            save()
        if "llamacpp" in args.peers:
            port = free_port()
            gguf_path = resolved_model_path(model)
            server = ServerProcess("llamacpp", llamacpp_command(gguf_path, port, args), dict(os.environ), port,
                                   log_dir, ready_path="/v1/models")
            results["llamacpp"] = measure_server(server, args, requests, body=llamacpp_body(gguf_path),
                                                 to_text=to_text)
            save()
        if "in-process" in args.peers:  # last: its engine keeps this process's device memory to the end
            in_process_kwargs = {**engine_kwargs, "engine_core": (args.engine_core or ["thread"])[0].partition("@")[0]}
            results["hearth-in-process"] = measure_in_process(model, in_process_kwargs, requests, args, to_text)
            save()
    finally:
        for server in started.values():  # (a server never reached, when the run was cut short)
            server.stop()
        shutil.rmtree(work_dir, ignore_errors=True)
    report = report_of(args, results)
    shown = {**_earlier_results(args.compare, report), **results}
    print(table(shown, args.rates))
    for line in ratios(shown, args.rates) + cpu_lines(shown):
        print(line)
    print(f"load average {os.getloadavg()[0]:.2f}; latencies in ms; {args.num_prompts} requests per rate", flush=True)


def report_of(args, results: dict[str, dict]) -> dict:
    """What ``--json`` holds: the workload, the load and every server's results so far."""
    return {"model": args.shape or args.model, "device": args.device, "num_prompts": args.num_prompts,
            "input_lengths": args.input_lengths, "output_lengths": args.output_lengths,
            "load_average": os.getloadavg(), "settings": scheduler_settings(args), "results": results}


if __name__ == "__main__":
    main()
