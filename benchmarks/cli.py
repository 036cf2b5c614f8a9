"""``hearth-llm bench NAME ...``: runs ``hearth_llm.benchmarks.MODULE.main(...)`` with the rest of the
arguments, so each benchmark keeps its own options and ``--help``."""
from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = {  # NAME: (MODULE, what it measures)
    "throughput": ("throughput", "GPU: tokens/s and batch-1 latency against HF continuous batching"),
    "cpu": ("cpu", "CPU: single stream, 32 concurrent, prefill and cold load against HF and llama.cpp"),
    "embeddings": ("embeddings", "sentences/s against sentence-transformers"),
    "langchain": ("langchain_chat", "ChatHearth.abatch against ChatHuggingFace.batch, 32 chats"),
    "spec": ("spec_decode", "batch-1 decode tok/s with and without speculative decoding (ngram, draft)"),
    "serving": ("serving", "the OpenAI server under streaming clients: TTFT/ITL/throughput against a peer"),
    "cold-start": ("cold_start", "a fresh process to its first token, phase by phase (imports, weights, graphs)"),
    "gguf-cpu": ("gguf_cpu", "CPU: GGUF files (SmolLM2 Q4_1, 1B Q4_K_M/Q8_0) against llama.cpp on the same file"),
    "int8-quality": ("int8_quality", "CPU: how far cpu_int8_activations moves greedy answers from the exact path"),
}


def add_bench_command(commands: argparse._SubParsersAction) -> None:
    """Adds ``bench`` to a ``hearth-llm`` subcommand table (``hearth_llm.engine.cli.build_parser``).

    >>> from hearth_llm.engine.cli import build_parser, run
    >>> parser, commands = build_parser()
    >>> add_bench_command(commands)
    >>> run(parser, ["bench", "cpu", "--help"])  # doctest: +SKIP
    """
    bench_parser = commands.add_parser(
        "bench", help="benchmarks against peers (the README's comparison numbers)",
        description="Benchmarks; arguments after the name go to it (hearth-llm bench cpu --help).")
    benchmarks = bench_parser.add_subparsers(dest="benchmark", required=True)
    for name, (_, summary) in BENCHMARKS.items():
        # No options of its own: --help and the rest reach the benchmark's parser untouched.
        benchmarks.add_parser(name, help=summary, add_help=False)
    bench_parser.set_defaults(run=run_benchmark, forwards_unknown_args=True)


def run_benchmark(args: argparse.Namespace) -> None:
    module_name, _ = BENCHMARKS[args.benchmark]
    module = importlib.import_module(f".{module_name}", __package__)  # heavy peers load only when asked
    sys.argv[0] = f"hearth-llm bench {args.benchmark}"  # what the benchmark's own usage line shows
    module.main(args.forwarded_argv)
