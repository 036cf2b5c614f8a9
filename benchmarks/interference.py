"""CPU interference: engine decode speed while the caller's thread runs torch, in-thread vs child process.

For each place the engine core can run (``engine_core="thread"`` and ``"process"``) it measures the
engine's decode speed while the caller's own thread runs torch, and the caller's torch speed while
the engine decodes.

    hearth-llm bench cpu --interference [--rounds 2] [--designs thread,process]
    python -m hearth_llm.benchmarks.interference ...

Why: torch's OpenMP runtime (libgomp) is one per process; once two threads have each run parallel
torch work, it stops idle threads from spinning and every short parallel region of a decode step
pays a sleep and a wake-up. That state cannot be undone inside a process, so each design runs in a
fresh Python process per round (designs alternate, A/B/A/B, so both see the same stretch of
machine load), and in each one, in this order:

1. **alone**: the engine decodes (after one warm-up run of each measure), the main thread has run no
   torch op yet;
2. the main thread runs ``--matmul-s`` seconds of 512x512 float32 matmuls (its speed **alone**);
3. **after**: the engine decodes again (the notebook case: some torch work happened earlier);
4. **while**: the engine decodes while the main thread runs matmuls the whole time (both speeds).

Each engine measure is single-stream decode (tok/s after the first token) and 32 concurrent
streams (aggregate tok/s, prefill included), on the bundled SmolLM2-135M Q4_1 GGUF with default
settings. The table shows the median over rounds and the engine's figures relative to its own
"alone" figures; the goal is "after" >= 0.9x alone with the main thread's matmuls not slower.

Read it only from a quiet machine (the load average is printed before and after). On a busy one
the comparison turns over: a libgomp team that spins (one team per process: the child engine,
or the caller's torch in the process design) burns its time slice waiting at a barrier for a
partner thread that another process holds off the core, while the short spins libgomp falls
back to once a process holds two teams yield at once. Measured at load 9-10 on this 2-core Xeon:
the caller's 512x512 fp32 matmuls ran at 50-70/s beside an idle child engine and at 190-280/s
beside an idle in-thread one, on the same ~0.5 core of CPU time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

SINGLE_TOKENS = 64
CONCURRENT_STREAMS = 32
CONCURRENT_TOKENS = 32
MATMUL_SIZE = 512
DESIGNS = ("thread", "process")
# Also accepted by --designs: the in-thread core with release_caller_threads on or off, whatever the default.
VARIANTS = ("thread-release", "thread-keep")
MEASURES = ("single_alone", "concurrent_alone", "matmul_alone", "single_after", "concurrent_after",
            "single_while", "matmul_while_single", "concurrent_while", "matmul_while_concurrent")


# ---- one design, in its own process ------------------------------------------------------------


def _chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


class _Engine:
    """The measures of one engine, through the public API only (``LLM`` and its shared core)."""

    def __init__(self, design: str) -> None:
        from hearth_llm.engine import LLM, SamplingParams, get_engine

        started = time.perf_counter()
        engine_core, _, variant = design.partition("-")
        kwargs = {"show_progress": False, "engine_core": engine_core}
        if variant:
            kwargs["release_caller_threads"] = variant == "release"
        self.llm = LLM("default", **kwargs)
        self.core = get_engine("default", **kwargs)
        self.load_s = time.perf_counter() - started
        self.tokenizer = self.llm.tokenizer
        self.single_params = SamplingParams(temperature=0, max_tokens=SINGLE_TOKENS, ignore_eos=True)
        self.concurrent_params = SamplingParams(temperature=0, max_tokens=CONCURRENT_TOKENS, ignore_eos=True)
        self.num_runs = 0
        self.llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        # Warm-up of both measures before "alone": a first 32-stream batch meets new shapes while the
        # thread governor still times its candidates. Its first run was 4-6x slower than the next one
        # (2 busy cores: 9 -> 50 tok/s in-thread, 76 -> 333 in a child process), which made "alone"
        # low and "after / alone" look better than it was.
        self.single()
        self.concurrent()

    def single(self) -> float:
        self.num_runs += 1  # a new prompt each run: no prefix-cache hit
        prompt = _chat_ids(self.tokenizer, f"Tell me a long story about a lighthouse (run {self.num_runs}).")
        times = []
        for output in self.core.add_request(prompt, self.single_params):
            times.extend([time.perf_counter()] * len(output.delta_token_ids))
        return (len(times) - 1) / (times[-1] - times[0])

    def concurrent(self) -> float:
        self.num_runs += 1
        prompts = [_chat_ids(self.tokenizer, f"Write a short poem about topic {i} (run {self.num_runs}).")
                   for i in range(CONCURRENT_STREAMS)]
        started = time.perf_counter()
        outputs = self.llm.generate(prompts, self.concurrent_params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)


def _matmuls(seconds: float | None = None, until: threading.Event | None = None) -> float:
    """Matmuls per second on this thread, for ``seconds`` or until ``until`` is set."""
    import torch

    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    count, started = 0, time.perf_counter()
    while (time.perf_counter() - started < seconds) if seconds is not None else not until.is_set():
        torch.mm(a, a)
        count += 1
    return count / (time.perf_counter() - started)


def _while_matmuls(measure) -> tuple[float, float]:
    """The engine measure run from a helper thread while this (main) thread runs matmuls throughout."""
    done, result = threading.Event(), {}

    def run() -> None:
        try:
            result["rate"] = measure()
        finally:
            done.set()

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    matmul_rate = _matmuls(until=done)
    reader.join()
    return result["rate"], matmul_rate


def run_design(design: str, matmul_s: float) -> dict:
    """Every measure of one design, in the order the module docstring gives (this process is fresh)."""
    engine = _Engine(design)
    values = {"load_s": engine.load_s, "dtype": str(engine.llm.engine.dtype if design == "process"
                                                     else engine.llm.engine.runner.dtype)}
    values["single_alone"] = engine.single()
    values["concurrent_alone"] = engine.concurrent()
    values["matmul_alone"] = _matmuls(matmul_s)  # from here on the main thread has its OpenMP team
    values["single_after"] = engine.single()
    values["concurrent_after"] = engine.concurrent()
    values["single_while"], values["matmul_while_single"] = _while_matmuls(engine.single)
    values["concurrent_while"], values["matmul_while_concurrent"] = _while_matmuls(engine.concurrent)
    engine.llm.close()
    return values


# ---- the driver: designs interleaved over rounds -----------------------------------------------


def _run_child(design: str, matmul_s: float, timeout_s: float) -> dict:
    command = [sys.executable, "-m", "hearth_llm.benchmarks.interference", "--worker", design,
               "--matmul-s", str(matmul_s)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:g} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:120]}
    return json.loads(lines[-1])


def _median(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if isinstance(run.get(key), (int, float))]
    return statistics.median(values) if values else None


def print_table(results: dict[str, list[dict]]) -> None:
    rows = [
        ("single stream, engine alone", "single_alone", "single_alone"),
        ("single stream, after 1 s of main-thread torch", "single_after", "single_alone"),
        ("single stream, main thread runs torch throughout", "single_while", "single_alone"),
        ("32 streams, engine alone", "concurrent_alone", "concurrent_alone"),
        ("32 streams, after 1 s of main-thread torch", "concurrent_after", "concurrent_alone"),
        ("32 streams, main thread runs torch throughout", "concurrent_while", "concurrent_alone"),
        ("main-thread matmuls/s, engine idle", "matmul_alone", "matmul_alone"),
        ("main-thread matmuls/s, engine decodes 1 stream", "matmul_while_single", "matmul_alone"),
        ("main-thread matmuls/s, engine decodes 32 streams", "matmul_while_concurrent", "matmul_alone"),
    ]
    designs = list(results)
    header = f"{'':<52}" + "".join(f"{design:>22}" for design in designs)
    print("\n" + header + "\n" + "-" * len(header))
    for label, key, base in rows:
        cells = []
        for design in designs:
            value, reference = _median(results[design], key), _median(results[design], base)
            if value is None:
                cells.append(f"{'n/a':>22}")
            elif key == base:
                cells.append(f"{value:>14.1f}        ")
            else:
                cells.append(f"{value:>14.1f} ({value / reference:4.2f}x)")
        print(f"{label:<52}" + "".join(cells))
    loads = "".join(f"{_median(results[design], 'load_s') or float('nan'):>22.1f}" for design in designs)
    print(f"{'LLM(...) load seconds':<52}{loads}")
    print("engine tok/s: single stream after the first token; 32 streams aggregate with prefill; medians of "
          f"{max(len(runs) for runs in results.values())} round(s); (x) relative to the design's own first row")


def print_goals(results: dict[str, list[dict]]) -> None:
    print("\ngoals (after 1 s of main-thread torch >= 0.9x engine alone; main-thread torch not slower than "
          "with the in-thread engine):")
    thread_matmul = _median(results.get("thread", []), "matmul_while_single")
    for design, runs in results.items():
        for what in ("single", "concurrent"):
            alone, after = _median(runs, f"{what}_alone"), _median(runs, f"{what}_after")
            if alone and after:
                ratio = after / alone
                print(f"  {design:<8} {what:<11} {ratio:4.2f}x  {'met' if ratio >= 0.9 else 'NOT met'}")
        matmul = _median(runs, "matmul_while_single")
        if design != "thread" and matmul and thread_matmul:
            print(f"  {design:<8} main-thread matmuls while decoding: {matmul / thread_matmul:4.2f}x the "
                  "in-thread design's")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per design, alternating designs")
    parser.add_argument("--designs", default=",".join(DESIGNS),
                        help="comma-separated: thread,process (and thread-release, thread-keep: the in-thread core with "
                             "release_caller_threads on / off)")
    parser.add_argument("--matmul-s", type=float, default=1.0, help="seconds of main-thread matmuls before 'after'")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="limit for one design's process")
    parser.add_argument("--json", help="also write every round's values to this file")
    parser.add_argument("--worker", choices=DESIGNS + VARIANTS, help=argparse.SUPPRESS)  # one design, in this process
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_design(args.worker, args.matmul_s)), flush=True)
        return
    designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    unknown = sorted(set(designs) - set(DESIGNS + VARIANTS))
    if unknown or not designs:
        raise SystemExit(f"--designs must name some of {list(DESIGNS + VARIANTS)}, got {args.designs!r}")
    flags = _cpu_line()
    load_before = os.getloadavg()
    print(f"{flags}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; "
          f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    results: dict[str, list[dict]] = {design: [] for design in designs}
    started = time.perf_counter()
    for round_index in range(args.rounds):
        for design in designs if round_index % 2 == 0 else designs[::-1]:
            values = _run_child(design, args.matmul_s, args.timeout_s)
            values["load_avg_1m"] = os.getloadavg()[0]
            results[design].append(values)
            summary = values.get("error") or (f"single {values['single_alone']:.1f} -> {values['single_after']:.1f}, "
                                              f"32 streams {values['concurrent_alone']:.1f} -> "
                                              f"{values['concurrent_after']:.1f} tok/s, dtype {values['dtype']}")
            print(f"round {round_index + 1} {design:<8} {summary}  (load {values['load_avg_1m']:.2f})", flush=True)
    print_table(results)
    print_goals(results)
    load_after = os.getloadavg()
    print(f"\nload average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{time.perf_counter() - started:.0f} s in all"
          + ("  (a busy machine: rerun when it is quiet)" if max(load_before[0], load_after[0]) > 1.5 else ""))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"results": results, "load": [load_before[0], load_after[0]], "cpu": flags}, file, indent=2)


def _cpu_line() -> str:
    from hearth_llm.engine.cpu_features import describe_cpu_path

    return f"{describe_cpu_path()}; {len(os.sched_getaffinity(0))} cores"


if __name__ == "__main__":
    main()
