"""CPU speed on GGUF files against llama.cpp (llama-cpp-python) running the same file.

    hearth-llm bench gguf-cpu [--models smollm2-q4_1,llama1b-q4_k_m,llama1b-q8_0] [--threads 1,2]
                              [--llama-cpp-python /tmp/llamacpp-venv/bin/python] [--repeats 2]

Every system runs in its own worker process (so its resident memory is its own), loaded from the same
GGUF file, fed the same prompt token ids, greedy, with the same thread count. The parent sends each
measure to every worker in turn, repeat by repeat (interleaved), because timings on a shared machine
drift; the table keeps each system's best repeat and prints the load average before and after.

Systems: ``hearth`` (the default path: in bf16, linear weights stay in the file's blocks, run by the C
kernels of ``kernels/quant/gguf_cpu_native.py``, pure Q4_0/Q4_1 layers' decode steps too, their prefill on a dense
bf16 copy), ``hearth int4pack`` (the same with those Q4 decode steps on torch's int4 kernel, bf16 scales), ``hearth gguf``
(``quantization="gguf"``: every GGUF linear in its blocks), ``hearth dense`` (on a CPU without AVX-512
BF16, where the engine runs float32: the dense float32 weights the float32 path had before the AVX2 panel
kernels), ``hearth no-amx`` (on an AMX CPU, batches as before the AMX tiles: pure Q4_0/Q4_1 layers on their
dense bf16 copy, other block layers on gguf_cpu's tiled torch path) and ``llama.cpp``. After each table, each
system's CPU time per decoded token (all threads, prefill excluded), the steadier figure on a shared machine.

1. single stream: decode tok/s over ``--decode-tokens`` new tokens after a 16-token prompt (prefill excluded);
2. prefill: tok/s to the first token of a 500-token prompt (a new prompt each repeat: no prefix hit);
3. 32 concurrent chats of ``--chat-tokens`` new tokens: aggregate tok/s, prefill included. Ours runs them as one batch; llama-cpp-python
   has no batched generation, so llama.cpp runs ``--sequential-sample`` of them one after another
   (sequential calls: without batching the rate does not depend on how many);
4. resident memory (VmRSS) after load and a warm-up, against the file's size: the whole process, and what
   the load added to it (after the libraries were imported: torch alone is ~300 MiB).

A full run (3 files x 1 and 2 threads, 2 repeats) took 12.5 min on 2 shared cores (the 1B files' loads
and llama.cpp's sequential chats dominate); ``--models``/``--threads`` pick a part.
Random-weight 1B files are written once (``benchmarks/gguf_files.py``) and cached in ``--work-dir``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MEASURES = ("single", "prefill", "concurrent")
NUM_CONCURRENT = 32
PREFILL_TOKENS = 500
SINGLE_PROMPT_TOKENS = 16
CHAT_PROMPT_TOKENS = (16, 48)
MODELS = ("smollm2-q4_1", "llama1b-q4_k_m", "llama1b-q8_0")
DEFAULT_LLAMA_CPP_PYTHON = "/tmp/llamacpp-venv/bin/python"
LLAMA_CPP = "llama.cpp"
# Our KV pool: enough for the 32 chats and the 500-token prompt (SmolLM2 ~23 KiB/token, the 1B ~32 KiB),
# about what llama.cpp's n_ctx=2048 f16 cache takes. (512 MiB measured only 60-130 MiB more RSS: untouched
# pages of the pool are not resident.)
KV_CACHE_MEMORY = "64MiB"


# ---- the table: pure functions of the measured numbers (tests/test_bench_gguf_cpu.py) ----------------


@dataclass
class SystemResult:
    """One worker's numbers: each measure's repeats (tok/s), its resident bytes and load seconds."""

    rates: dict[str, list[float]] = field(default_factory=dict)
    rss_bytes: int = 0
    load_s: float = 0.0
    rss_before_load: int = 0  # after importing the libraries (torch, llama_cpp), before the model

    def best(self, measure: str) -> float | None:
        values = self.rates.get(measure) or []
        return max(values) if values else None


def ratio(ours: float | None, peer: float | None) -> float | None:
    """``ours / peer``, None when either side is missing or the peer measured zero."""
    if ours is None or peer is None or peer <= 0:
        return None
    return ours / peer


def table_rows(results: dict[str, SystemResult], file_bytes: int) -> list[list[str]]:
    """One row per system: best tok/s per measure with its ratio to llama.cpp, and RSS / file size.

    >>> rows = table_rows({"llama.cpp": SystemResult({"single": [10.0]}, 100), "hearth": SystemResult({"single": [12.0]}, 110)}, 100)
    >>> rows[1][1]
    '12.0 (1.20x)'
    """
    peer = results.get(LLAMA_CPP)
    rows = []
    for name, result in results.items():
        row = [name]
        for measure in MEASURES:
            value = result.best(measure)
            share = ratio(value, peer.best(measure)) if peer is not None and name != LLAMA_CPP else None
            row.append("-" if value is None else f"{value:.1f}" + ("" if share is None else f" ({share:.2f}x)"))
        memory = result.rss_bytes / file_bytes if file_bytes else 0.0
        row.append(f"{result.rss_bytes / 2**20:.0f} MiB ({memory:.2f}x file)")
        added = result.rss_bytes - result.rss_before_load
        row.append(f"{added / 2**20:.0f} MiB ({added / file_bytes if file_bytes else 0.0:.2f}x file)")
        row.append(f"{result.load_s:.1f}")
        rows.append(row)
    return rows


def cpu_time_line(results: dict[str, SystemResult]) -> str:
    """Each system's best CPU ms per decoded token (all its threads, from the first token to the last).

    >>> cpu_time_line({"hearth": SystemResult({"single_cpu": [0.2, 0.1]})})
    'decode CPU ms/token (all threads): hearth 100.0'
    """
    parts = [f"{name} {min(r.rates['single_cpu']) * 1e3:.1f}" for name, r in results.items() if r.rates.get("single_cpu")]
    return "decode CPU ms/token (all threads): " + ", ".join(parts)


HEADER = ["system", "decode tok/s", f"prefill {PREFILL_TOKENS} tok/s", f"{NUM_CONCURRENT} chats tok/s",
          "RSS after load", "RSS added by the load", "load s"]


def format_table(title: str, rows: list[list[str]]) -> str:
    """A markdown table under ``title``."""
    lines = [f"### {title}", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---- prompts: the parent draws the token ids, every worker gets the same ones --------------------------


def prompt_ids(seed: int, length: int, vocab_size: int) -> list[int]:
    """``length`` token ids, fixed by ``seed``, away from the special tokens at the start of the vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(16, vocab_size) for _ in range(length)]


def requests_for(measure: str, repeat: int, vocab_size: int, num_new_tokens: int) -> dict:
    """The message a worker gets for one repeat of ``measure`` (prompts differ by repeat: no prefix hits)."""
    seed = 1000 * MEASURES.index(measure) + repeat
    if measure == "single":
        return {"measure": measure, "prompt": prompt_ids(seed, SINGLE_PROMPT_TOKENS, vocab_size),
                "num_new_tokens": num_new_tokens}
    if measure == "prefill":
        return {"measure": measure, "prompt": prompt_ids(seed, PREFILL_TOKENS, vocab_size)}
    rng = random.Random(seed)
    prompts = [prompt_ids(seed * 100 + i, rng.randint(*CHAT_PROMPT_TOKENS), vocab_size) for i in range(NUM_CONCURRENT)]
    return {"measure": measure, "prompts": prompts, "num_new_tokens": num_new_tokens}


# ---- workers ------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _without_extra_buffer_types() -> None:
    """llama.cpp repacks weights for AMX on a CPU that reports it; on this machine (Xeon, AMX listed in
    /proc/cpuinfo) the first AMX matmul dies with SIGILL. ``use_extra_bufts=False`` (llama.cpp's
    ``--no-extra-bufts``) keeps its AVX-512 kernels; Llama() has no argument for it, so its default
    model params are patched."""
    import llama_cpp.llama_cpp as api

    defaults = api.llama_model_default_params

    def without_extra_bufts():
        params = defaults()
        params.use_extra_bufts = False
        return params

    api.llama_model_default_params = without_extra_bufts


class _LlamaCppWorker:
    """llama-cpp-python on the file; its 32 chats run one after another (no batched generation API)."""

    def __init__(self, model: str, num_threads: int, sequential_sample: int):
        _without_extra_buffer_types()
        from llama_cpp import Llama

        self.llm = Llama(model, n_threads=num_threads, n_threads_batch=num_threads, n_ctx=2048, n_batch=512,
                         verbose=False)
        self.vocab_size = self.llm.n_vocab()
        self.sequential_sample = sequential_sample

    def _token_times(self, prompt: list[int], num_new_tokens: int) -> list[float]:
        self.llm.reset()
        times, self.cpu_times = [], []
        for _ in self.llm.generate(prompt, temp=0.0, reset=True):
            times.append(time.perf_counter())
            self.cpu_times.append(time.process_time())
            if len(times) == num_new_tokens:
                break
        return times

    def single(self, prompt, num_new_tokens) -> float:
        times = self._token_times(prompt, num_new_tokens)
        self.cpu_per_token = (self.cpu_times[-1] - self.cpu_times[0]) / (len(times) - 1)
        return (len(times) - 1) / (times[-1] - times[0])

    def single_cpu(self) -> float:
        """CPU seconds (all threads) per token of the last ``single`` run, after the first token."""
        return self.cpu_per_token

    def prefill(self, prompt) -> float:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - started)

    def concurrent(self, prompts, num_new_tokens) -> float:
        started = time.perf_counter()
        num_tokens = sum(len(self._token_times(p, num_new_tokens)) for p in prompts[:self.sequential_sample])
        return num_tokens / (time.perf_counter() - started)


class _HearthWorker:
    """Our engine on the file; ``quantization`` None is the default path, "gguf" keeps the blocks;
    ``int8``: ``cpu_int8_activations=True`` (decode steps on int8 activations, as llama.cpp)."""

    def __init__(self, model: str, num_threads: int, quantization: str | None, int8: bool = False,
                 dtype: str = "auto"):
        from hearth_llm.engine import LLM, SamplingParams, get_engine

        options = dict(num_threads=num_threads, adaptive_threads=False, quantization=quantization,
                       show_progress=False, kv_cache_memory=KV_CACHE_MEMORY, dtype=dtype)
        if int8:
            options["cpu_int8_activations"] = True
        self.llm = LLM(model, **options)
        self.core = get_engine(model, **options)  # the engine llm drives, for its token stream
        self.params = SamplingParams
        self.vocab_size = self.llm.engine.vocab_size

    def _greedy(self, num_new_tokens: int):
        return self.params(temperature=0, max_tokens=num_new_tokens, ignore_eos=True)

    def single(self, prompt, num_new_tokens) -> float:
        times, cpu_times = [], []
        for output in self.core.add_request(prompt, self._greedy(num_new_tokens)):
            times.extend([time.perf_counter()] * len(output.delta_token_ids))
            cpu_times.extend([time.process_time()] * len(output.delta_token_ids))
        self.cpu_per_token = (cpu_times[-1] - cpu_times[0]) / (len(times) - 1)
        return (len(times) - 1) / (times[-1] - times[0])

    def single_cpu(self) -> float:
        """CPU seconds (all threads) per token of the last ``single`` run, after the first token."""
        return self.cpu_per_token

    def prefill(self, prompt) -> float:
        started = time.perf_counter()
        self.llm.generate([prompt], self._greedy(1), use_tqdm=False)
        return len(prompt) / (time.perf_counter() - started)

    def concurrent(self, prompts, num_new_tokens) -> float:
        started = time.perf_counter()
        outputs = self.llm.generate(prompts, self._greedy(num_new_tokens), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)


def worker_main(args) -> None:
    """A worker: loads, warms up, says ``ready`` (vocab, RSS), then answers one JSON request per line."""
    if args.worker == "llama":  # the libraries first: what loading the model adds is measured apart
        import llama_cpp  # noqa: F401
    else:
        import hearth_llm.engine  # noqa: F401
    rss_before_load = _rss_bytes()
    started, threads = time.perf_counter(), int(args.threads)
    if args.worker == "llama":
        worker = _LlamaCppWorker(args.model, threads, args.sequential_sample)
    else:
        if args.int4pack:  # the A/B: pure Q4_0/Q4_1 layers on torch's int4 layout (bf16 scales), as before
            from hearth_llm.engine.models import gguf_linear_method

            gguf_linear_method._exact_blocks = lambda quant_type, dtype: False
        if args.no_amx:  # the A/B on an AMX CPU: batches on dense copies / torch tiles, as before the AMX tiles
            from hearth_llm.kernels.quant import gguf_cpu_native

            gguf_cpu_native.has_amx = lambda: False
        if args.no_panels:  # the A/B on a float32 CPU: dense float32 weights, as before the AVX2 panel kernels
            from hearth_llm.kernels.quant import gguf_cpu_native

            gguf_cpu_native.has_panels = lambda quant_type: False
        if args.no_k_blocks:  # the A/B on a float32 CPU: K-quant layers and heads dequantized, Q4/Q8 panel
            from hearth_llm.engine.models import gguf_linear_method  # layers with a dense copy, as before
            from hearth_llm.kernels.quant import gguf_cpu_native

            gguf_linear_method.FLOAT32_DENSE_COPY = True

            has_vector_float32 = gguf_cpu_native.has_vector_float32
            gguf_cpu_native.has_vector_float32 = lambda quant_type: (quant_type in ("Q4_0", "Q4_1", "Q8_0")
                                                                     and has_vector_float32(quant_type))
        worker = _HearthWorker(args.model, threads, args.quantization, args.int8, args.dtype)
    load_s = time.perf_counter() - started
    worker.single(prompt_ids(7, 8, worker.vocab_size), 4)  # warm-up: first-call costs out of the numbers
    print(json.dumps({"ready": True, "vocab_size": worker.vocab_size, "rss_bytes": _rss_bytes(),
                      "rss_before_load": rss_before_load,
                      "load_s": load_s}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        measure = request.pop("measure")
        print(json.dumps({"value": getattr(worker, measure)(**request)}), flush=True)


class WorkerProcess:
    """The parent's end of a worker: start it, read its ``ready`` line, send requests."""

    def __init__(self, command: list[str], env: dict):
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self._read()

    def _read(self) -> dict:
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.process.args[:4]} exited with {self.process.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, request: dict) -> float:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()["value"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


# ---- the parent --------------------------------------------------------------------------------------


def model_file(name: str, work_dir: Path, llama_cpp_python: str) -> Path:
    """The GGUF file a ``--models`` name stands for (the 1B ones made on first use)."""
    if name == "smollm2-q4_1":
        from hearth_llm.engine.loader import default_model_path

        return Path(default_model_path())
    from .gguf_files import LLAMA_1B, quantized_llama

    quant_types = {"llama1b-q4_k_m": "Q4_K_M", "llama1b-q8_0": "Q8_0"}
    if name not in quant_types:
        raise ValueError(f"--models: unknown model {name!r}; choose from {list(MODELS)}")
    return quantized_llama(LLAMA_1B, quant_types[name], work_dir, llama_cpp_python)


def worker_commands(path: Path, threads: int, args) -> dict[str, list[str]]:
    this_file = str(Path(__file__).resolve())
    common = ["--model", str(path), "--threads", str(threads), "--sequential-sample", str(args.sequential_sample)]
    commands = {"hearth": [sys.executable, this_file, "--worker", "hearth", *common],
                "hearth gguf": [sys.executable, this_file, "--worker", "hearth", "--quantization", "gguf", *common],
                "hearth int4pack": [sys.executable, this_file, "--worker", "hearth", "--int4pack", *common],
                "hearth dense": [sys.executable, this_file, "--worker", "hearth", "--no-panels", *common],
                "hearth no-amx": [sys.executable, this_file, "--worker", "hearth", "--no-amx", *common],
                "hearth int8": [sys.executable, this_file, "--worker", "hearth", "--int8", *common],
                "hearth float32": [sys.executable, this_file, "--worker", "hearth", "--dtype", "float32", *common],
                "hearth float32 dense": [sys.executable, this_file, "--worker", "hearth", "--dtype", "float32",
                                         "--no-k-blocks", *common]}
    if not args.skip_llama_cpp:
        commands[LLAMA_CPP] = [args.llama_cpp_python, this_file, "--worker", "llama", *common]
    return {name: command for name, command in commands.items() if name in args.systems or name == LLAMA_CPP}


def _worker_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def run_one(name: str, path: Path, threads: int, args) -> dict[str, SystemResult]:
    """Loads every system on ``path`` one after another (their RSS apart), then interleaves the measures."""
    workers, results = {}, {}
    try:
        for system, command in worker_commands(path, threads, args).items():
            workers[system] = WorkerProcess(command, _worker_env(threads))
            ready = workers[system].ready
            results[system] = SystemResult(rss_bytes=ready["rss_bytes"], load_s=ready["load_s"],
                                           rss_before_load=ready["rss_before_load"])
        vocab_size = min(w.ready["vocab_size"] for w in workers.values())
        decode_tokens = args.decode_tokens if "smollm" in name else args.decode_tokens_1b
        for measure in args.measures:
            for repeat in range(args.repeats):
                num_new_tokens = args.chat_tokens if measure == "concurrent" else decode_tokens
                request = requests_for(measure, repeat, vocab_size, num_new_tokens)
                for system, worker in workers.items():
                    started = time.perf_counter()
                    results[system].rates.setdefault(measure, []).append(worker.ask(dict(request)))
                    if measure == "single":  # on a shared machine the CPU time per token is the steadier figure
                        results[system].rates.setdefault("single_cpu", []).append(worker.ask({"measure": "single_cpu"}))
                    print(f"  {name} t={threads} {measure} #{repeat} {system}: {results[system].rates[measure][-1]:.1f} "
                          f"tok/s ({time.perf_counter() - started:.1f} s, loadavg {_loadavg()})", file=sys.stderr,
                          flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return results


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="hearth-llm bench gguf-cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts (each system the same)")
    parser.add_argument("--systems", default="hearth,hearth gguf",
                        help="ours to run: 'hearth', 'hearth gguf', 'hearth int4pack' (pure Q4_0/Q4_1 layers on "
                             "torch's int4 kernel, the path before the exact Q4 kernels), 'hearth dense' (on a "
                             "float32 CPU: dense float32 weights, the path before the AVX2 panel kernels), 'hearth no-amx' (on an "
                             "AMX CPU: batches on dense copies / torch tiles, the path before the AMX tiles), 'hearth int8' "
                             "(cpu_int8_activations=True: decode steps on int8 activations, not exact), 'hearth float32' "
                             "(dtype='float32', the path of CPUs without AVX-512 BF16; with "
                             "HEARTH_LLM_KERNEL_CFLAGS=-mno-avx512f its AVX2 kernels), 'hearth float32 dense' (the same with "
                             "K-quant layers and heads dequantized at load and Q4/Q8 panel layers keeping a dense "
                             "float32 copy for batches: the float32 path before 2026-12-03's AVX2 K-quant kernels)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--measures", default=",".join(MEASURES), help=f"comma-separated, from {list(MEASURES)}")
    parser.add_argument("--decode-tokens", type=int, default=32, help="new tokens per stream, SmolLM2")
    parser.add_argument("--decode-tokens-1b", type=int, default=12, help="new tokens per stream, 1B files")
    parser.add_argument("--chat-tokens", type=int, default=8, help="new tokens per chat of the 32")
    parser.add_argument("--sequential-sample", type=int, default=4, help="llama.cpp chats timed one by one")
    parser.add_argument("--llama-cpp-python", default=DEFAULT_LLAMA_CPP_PYTHON,
                        help="an interpreter with llama_cpp importable (its own venv)")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "hearth-llm" / "bench-gguf")
    parser.add_argument("--worker", choices=["hearth", "llama"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--quantization", help=argparse.SUPPRESS)
    parser.add_argument("--int4pack", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-panels", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-amx", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--int8", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--no-k-blocks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",")]
    args.measures = [m.strip() for m in args.measures.split(",")]
    if not set(args.measures) <= set(MEASURES):
        parser.error(f"--measures must be from {list(MEASURES)}, got {args.measures}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    from hearth_llm.engine.cpu_features import describe_cpu_path
    from hearth_llm.kernels.quant import gguf_cpu_q8x

    # which dtype the "hearth" system runs here and why, and which int8 kernels "hearth int8" gets
    print(f"{describe_cpu_path()}; int8-activation kernels: {gguf_cpu_q8x.path()}", flush=True)
    print(f"loadavg at start: {_loadavg()}", flush=True)
    for name in args.models.split(","):
        path = model_file(name.strip(), args.work_dir, args.llama_cpp_python)
        for threads in (int(t) for t in args.threads.split(",")):
            results = run_one(name, path, threads, args)
            title = f"{name} ({path.name}, {path.stat().st_size / 2**20:.0f} MiB), {threads} thread(s), " \
                    f"loadavg {_loadavg()}"
            print(format_table(title, table_rows(results, path.stat().st_size)), flush=True)
            print(cpu_time_line(results), flush=True)
    print(f"llama.cpp's {NUM_CONCURRENT}-chat rate: {args.sequential_sample} sequential calls; ours: one batch. "
          f"loadavg at end: {_loadavg()}", flush=True)


if __name__ == "__main__":
    main()
