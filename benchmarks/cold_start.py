"""Cold start: a fresh Python process to its first generated token, and where the seconds go.

    python -m hearth_llm.benchmarks.cold_start --write-checkpoint llama3-8b --model /tmp/llama3-8b
    python -m hearth_llm.benchmarks.cold_start --model /tmp/llama3-8b --repeats 2
    python -m hearth_llm.benchmarks.cold_start --write-checkpoint tiny-qwen3 --model /tmp/tq --device cpu

The model is a safetensors directory on local disk (``--write-checkpoint SHAPE`` writes one with
random weights of a :data:`~.shapes.SHAPES` shape: config.json, a word-level tokenizer, ~5 GB shards).
Each run starts a new interpreter that does what a user's script does, ``LLM(model)`` then
``generate(..., max_tokens=1)``, and times each phase of it on the way (the child installs timers around
the engine's load steps; nothing in the engine is changed). The children share one cache directory
(their HOME, so ``~/.cache/hearth_llm``'s config cache, and their Triton cache): the first run starts
with it empty (the first start after install), the others reuse it (every start after that). The page
cache is warm (the files were just written or read), as in the issue's measurement.

Phases (seconds from the launch of the child, each the time since the previous one):

- ``python``: interpreter start until the child's first line;
- ``import torch`` / ``import hearth_llm.engine`` / ``import triton`` (each what the one before left);
- ``CUDA context``: the first CUDA call (every CUDA process pays it; done before ``LLM`` so it is not
  counted in the engine's own phases);
- inside ``LLM(...)``: ``config + tokenizer`` (opening the checkpoint), ``model build`` (the model on
  the meta device, then its memory on the device), ``weights`` (read + copy to the device, with the
  loader's own split), ``KV cache``, ``CUDA graphs`` (decode graphs captured, with the Triton JIT of
  the decode kernels), ``engine rest`` (the engine thread, scheduler, tokenizer-side setup);
- ``first token``: ``generate`` of one 128-token prompt, 1 new token (the prefill kernels' JIT);
- ``second token``: the same again, which is what a warm request costs (not part of the total).

``triton_compile`` counts the kernels Triton built or read from its disk cache, and their seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_SECONDS = 10.0
CHILD_FLAG = "--child"
_RESULT_PREFIX = "COLD_START_RESULT "
_PHASES = ("python", "import torch", "import hearth_llm.engine", "import triton",
           "CUDA context", "config + tokenizer", "model build", "weights", "KV cache", "CUDA graphs",
           "engine rest", "first token")


# ---- the parent -----------------------------------------------------------------------------

def run_child(options: dict, env: dict | None = None, timeout: float = 600) -> dict:
    """One fresh interpreter through :func:`child_main`; its phase timings (a dict), or
    ``{"error": ...}`` with the end of its stderr."""
    options = dict(options, launched_at=time.time())
    command = [sys.executable, "-m", "hearth_llm.benchmarks.cold_start", CHILD_FLAG, json.dumps(options)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - started
    for line in done.stdout.splitlines():
        if line.startswith(_RESULT_PREFIX):
            result = json.loads(line[len(_RESULT_PREFIX):])
            result["wall_s"] = wall
            return result
    tail = (done.stderr.strip().splitlines() or ["no output"])[-12:]
    return {"error": f"exit {done.returncode}: " + "\n".join(tail), "wall_s": wall}


def format_breakdown(runs: list[tuple[str, dict]]) -> str:
    """A table: one row per phase, one column per run (seconds)."""
    width = 26
    lines = [f"{'phase':<{width}}" + "".join(f"{label:>16}" for label, _ in runs)]
    for phase in _PHASES:
        if not any(phase in run.get("phases", {}) for _, run in runs):
            continue
        lines.append(f"{phase:<{width}}" + "".join(
            f"{run.get('phases', {}).get(phase, float('nan')):>16.2f}" for _, run in runs))
    for key, label in (("total_s", "TOTAL to first token"), ("second_token_s", "(a warm request)")):
        lines.append(f"{label:<{width}}" + "".join(f"{run.get(key, float('nan')):>16.2f}" for _, run in runs))
    for label, run in runs:
        if "error" in run:
            lines.append(f"{label}: FAILED {run['error']}")
            continue
        details = [f"{key}={run[key]}" for key in ("weights_read", "triton_compile", "graph_sizes", "config_from_cache",
                                                   "phases_not_timed",
                                                   "engine_import_loads_transformers", "dont_write_bytecode")
                   if key in run]
        if details:
            lines.append(f"{label}: " + "; ".join(details))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a safetensors model directory (written with --write-checkpoint)")
    parser.add_argument("--write-checkpoint", metavar="SHAPE",
                        help="first write random weights of this shape to --model (replacing what is there)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs: the first with the caches as --cache-dir has them (empty by default), the rest warm")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="EngineConfig.max_num_seqs (default: its own)")
    parser.add_argument("--kv-cache-memory", default=None, help="EngineConfig.kv_cache_memory (default: its own)")
    parser.add_argument("--cache-dir", help="the children's HOME (so ~/.cache: our config and GGUF caches) and, "
                                            "under it, their Triton cache; reuse one to start warm (default: a new "
                                            "empty one, so the first run is the first start after install)")
    parser.add_argument("--plain-reads", action="store_true",
                        help="load CUDA weights the old way (plain reads into pageable memory, copied by the "
                             "weight loaders) instead of the staged reads through pinned buffers: an A/B")
    parser.add_argument("--profile", help="write a cProfile summary of the last run's engine load (the "
                                          "engine thread's LLM(...) work) here")
    parser.add_argument("--no-compile-bytecode", action="store_true",
                        help="do not write our package's .pyc files first (pip install writes them for a wheel; a "
                             "checkout run with PYTHONDONTWRITEBYTECODE=1 would compile every module at each start)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: need >= 1")
    results = {"model": args.model, "device": args.device}
    if args.write_checkpoint:
        from .checkpoint_writer import write_random_checkpoint

        started = time.perf_counter()
        num_bytes = write_random_checkpoint(args.write_checkpoint, args.model, args.dtype)
        results["write_checkpoint"] = {"shape": args.write_checkpoint, "bytes": num_bytes,
                                       "seconds": time.perf_counter() - started}
        print(f"wrote {num_bytes / 1e9:.2f} GB of {args.write_checkpoint} to {args.model} in "
              f"{results['write_checkpoint']['seconds']:.1f} s", flush=True)
    if not args.no_compile_bytecode:
        results["compiled_modules"] = compile_package_bytecode()
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="hearth-cold-cache-")
    os.makedirs(cache_dir, exist_ok=True)
    env = {**os.environ, "HOME": cache_dir, "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton")}
    options = {"model": args.model, "device": args.device, "dtype": args.dtype,
               "max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory,
               "plain_reads": args.plain_reads}
    runs = []
    is_empty = not any(os.scandir(cache_dir))
    for index in range(args.repeats):
        label = ("nothing cached" if is_empty else "cached") if index == 0 else f"cached #{index}"
        is_last = index == args.repeats - 1
        result = run_child(dict(options, profile=args.profile if is_last else None), env)
        runs.append((label, result))
        print(f"{label}: {result.get('total_s', float('nan')):.2f} s to first token"
              + (f" ({result['error']})" if "error" in result else ""), flush=True)
        print(json.dumps(result), flush=True)  # kept even if a later run is cut short
    results["runs"] = dict(runs)
    print(format_breakdown(runs))
    warm = [run["total_s"] for label, run in runs if "total_s" in run and label != "nothing cached"]
    if warm:
        best = min(warm)
        print(f"cold start (caches warm), best: {best:.2f} s; goal <= {GOAL_SECONDS:.0f} s: "
              f"{'met' if best <= GOAL_SECONDS else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as sink:
            json.dump(results, sink, indent=2)


def compile_package_bytecode() -> int:
    """Write the ``.pyc`` files of our packages, as ``pip install`` does for the wheel; how many
    modules there are."""
    import compileall
    import importlib.util

    count = 0
    for package in ("engine", "kernels", "embeddings", "integrations", "benchmarks", "cli", "server"):
        spec = importlib.util.find_spec(f"hearth_llm.{package}")  # imports the namespace, not the package
        for directory in (spec.submodule_search_locations or []) if spec is not None else []:
            compileall.compile_dir(directory, quiet=1)
            count += sum(1 for _ in Path(directory).rglob("*.py"))
    return count


# ---- the child: runs in the fresh interpreter ---------------------------------------------------

class _Clock:
    """Phase timings: ``mark(name)`` ends the phase ``name`` now."""

    def __init__(self, launched_at: float) -> None:
        self.phases: dict[str, float] = {}
        self.missing: list[str] = []
        self.last = time.perf_counter()
        self.phases["python"] = time.time() - launched_at

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now

    def timed(self, owner, attribute: str, name: str):
        """Wrap ``owner.attribute`` so its calls end the phase before it and count as ``name`` (an
        attribute the engine no longer has is left out: its time stays in ``engine rest``)."""
        original = getattr(owner, attribute, None)
        if original is None:
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{attribute}")
            return

        def wrapper(*args, **kwargs):
            self.mark("engine rest")
            try:
                return original(*args, **kwargs)
            finally:
                self.mark(name)

        setattr(owner, attribute, wrapper)


def child_main(options: dict) -> None:
    clock = _Clock(options["launched_at"])
    import torch

    clock.mark("import torch")
    from hearth_llm.engine import LLM, SamplingParams

    clock.mark("import hearth_llm.engine")
    engine_imports_transformers = "transformers" in sys.modules
    is_cuda = options["device"] == "cuda"
    compiles = _count_triton_compiles() if is_cuda else None
    if is_cuda:
        clock.mark("import triton")
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        clock.mark("CUDA context")
    read_log = _capture_loader_log()
    _install_phase_timers(clock)
    if options.get("profile"):
        _profile_engine_load(options["profile"])
    if options.get("plain_reads"):
        from hearth_llm.engine.loader import model_loader

        model_loader._read_device = lambda plan, device: None  # the A/B: tensors read to host memory
    kwargs = {key: options[key] for key in ("max_num_seqs", "kv_cache_memory") if options.get(key) is not None}
    llm = LLM(options["model"], dtype=options["dtype"], device=options["device"], show_progress=False, **kwargs)
    clock.mark("engine rest")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = list(range(100, 228))
    llm.generate([prompt], params, use_tqdm=False)
    clock.mark("first token")
    total = sum(clock.phases.values())  # "first token" was just marked: the phases cover it all
    started = time.perf_counter()
    llm.generate([[token + 1 for token in prompt]], params, use_tqdm=False)
    result = {"phases": clock.phases, "total_s": total, "second_token_s": time.perf_counter() - started,
              "engine_import_loads_transformers": engine_imports_transformers}
    if read_log:
        result["weights_read"] = read_log[-1]
    if compiles is not None:
        result["triton_compile"] = f"{compiles['count']} kernels, {compiles['seconds']:.2f} s"
    if clock.missing:
        result["phases_not_timed"] = clock.missing
    result["config_from_cache"] = type(llm.engine.hf_config).__module__.endswith("config_cache")
    result["dont_write_bytecode"] = bool(sys.flags.dont_write_bytecode)
    graphs = getattr(llm.engine.runner, "decode_graphs", None)
    if graphs is not None:
        result["graph_sizes"] = len(graphs.sizes)
    print(_RESULT_PREFIX + json.dumps(result), flush=True)
    os._exit(0)  # the engine thread's teardown is no part of a cold start


def _install_phase_timers(clock: _Clock) -> None:
    from hearth_llm.engine import engine_core, llm_engine, model_runner
    from hearth_llm.engine.loader import model_loader
    from hearth_llm.engine.models.decoder import DecoderModel

    clock.timed(engine_core, "load_checkpoint", "config + tokenizer")  # where LLM(...) opens it
    clock.timed(llm_engine, "load_checkpoint", "config + tokenizer")
    clock.timed(model_runner, "load_model", "model build")  # minus the weights, marked inside it
    original_load_weights = DecoderModel.load_weights

    def load_weights(self, weights):
        clock.mark("model build")
        try:
            return original_load_weights(self, weights)
        finally:
            clock.mark("weights")

    DecoderModel.load_weights = load_weights
    del model_loader  # imported so the engine's own module objects are the ones patched above
    clock.timed(model_runner, "_zeros", "KV cache")
    clock.timed(model_runner.ModelRunner, "enable_cuda_graphs", "CUDA graphs")


def _profile_engine_load(path: str) -> None:
    """cProfile the engine thread's load (``EngineCore._load``); the summary goes to ``path``."""
    import cProfile
    import io
    import pstats

    from hearth_llm.engine.engine_core import EngineCore

    original = EngineCore._load

    def load(self):
        profiler = cProfile.Profile()
        try:
            return profiler.runcall(original, self)
        finally:
            summary = io.StringIO()
            pstats.Stats(profiler, stream=summary).sort_stats("cumulative").print_stats(60)
            with open(path, "w") as sink:
                sink.write(summary.getvalue())

    EngineCore._load = load


def _capture_loader_log() -> list[str]:
    """The loader's INFO lines (the staged reads' split of the weight time)."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("hearth_llm.loader")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    return lines


def _count_triton_compiles() -> dict:
    """Counts Triton's ``compile`` calls (a JIT build, or a read from its disk cache) and their seconds."""
    import triton.compiler

    counts = {"count": 0, "seconds": 0.0}
    original = triton.compiler.compile

    def compile(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            counts["count"] += 1
            counts["seconds"] += time.perf_counter() - started

    triton.compiler.compile = compile  # JITFunction picks it up from triton.compiler on its first launch
    return counts


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == CHILD_FLAG:
        child_main(json.loads(sys.argv[2]))
    else:
        main()
