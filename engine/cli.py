"""``hearth-llm``: the command line (``demo``, ``chat``, ``info``, ``generate``, ``bench``)."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "What is 12 multiplied by 7?",
    "Translate 'good morning' into Spanish.",
    "Name three planets in our solar system.",
    "Why is the sky blue? Answer briefly.",
    "Suggest a name for a friendly robot.",
    "What is photosynthesis?",
    "Write one sentence about the ocean.",
    "What should I pack for a weekend hiking trip?",
]


def demo(args) -> None:
    from .llm import LLM
    from .sampling_params import SamplingParams

    llm = LLM(args.model)
    conversations = [[{"role": "user", "content": prompt}] for prompt in DEMO_PROMPTS]
    started = time.perf_counter()
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    elapsed = time.perf_counter() - started
    for prompt, output in zip(DEMO_PROMPTS, outputs):
        print(f"\n>>> {prompt}\n{output.outputs[0].text.strip()}")
    stats = llm.stats()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    hit_rate = stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1)
    print(f"\n{len(outputs)} requests, {num_tokens} tokens in {elapsed:.1f} s: {num_tokens / elapsed:.1f} tok/s, "
          f"prefix-cache hit rate {hit_rate:.0%}")


def chat(args) -> None:
    """An interactive terminal chat: streamed answers, multi-turn history, /reset and /exit."""
    from .llm import LLM
    from .registry import ChatPrompt
    from .sampling_params import SamplingParams

    llm = LLM(args.model, show_progress=False)
    core = llm._core
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    history: list[dict] = []
    print("hearth-llm chat: type a message; /reset clears the history, /exit quits.", flush=True)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return
        if line == "/exit":
            return
        if line == "/reset":
            history.clear()
            print("(history cleared)", flush=True)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        pieces = []
        with core.add_request(ChatPrompt(list(history)), params) as stream:
            try:
                for out in stream:
                    pieces.append(out.delta_text)
                    print(out.delta_text, end="", flush=True)
            except KeyboardInterrupt:
                pass  # leaving the stream aborts the answer; the chat goes on
        answer = "".join(pieces)
        history.append({"role": "assistant", "content": answer})
        print(flush=True)


def info(args) -> None:
    from .llm import LLM

    llm = LLM(args.model, show_progress=False)
    engine = llm.engine
    stats = engine.stats()
    print(json.dumps({
        "model": args.model,
        "architecture": type(engine.runner.model).__name__,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "device": str(engine.runner.device),
        "max_model_len": engine.max_model_len,
        "kv_blocks": stats["num_total_blocks"],
        "kv_capacity_tokens": stats["num_total_blocks"] * engine.config.block_size,
        "block_size": engine.config.block_size,
        "features": ["paged-kv-cache", "prefix-caching", "continuous-batching", "chunked-prefill", "preemption",
                     "priorities", "seeded-sampling", "logprobs", "stop-strings"],
    }, indent=2))


def generate(args) -> None:
    from .llm import LLM
    from .sampling_params import SamplingParams

    source = open(args.input, encoding="utf-8") if args.input != "-" else sys.stdin
    prompts = [line.rstrip("\n") for line in source if line.strip()]
    llm = LLM(args.model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if args.chat \
        else llm.generate(prompts, params)
    sink = open(args.output, "w", encoding="utf-8") if args.output != "-" else sys.stdout
    for prompt, output in zip(prompts, outputs):
        record = {"prompt": prompt, "text": output.outputs[0].text, "finish_reason": output.outputs[0].finish_reason,
                  "num_cached_tokens": output.num_cached_tokens}
        sink.write(json.dumps(record, ensure_ascii=False) + "\n")


# ``hearth-llm bench NAME ...`` runs ``hearth_llm.engine.bench.MODULE.main(...)`` with the rest of the arguments.
BENCHMARKS = {  # NAME: (MODULE, what it measures)
    "throughput": ("throughput", "GPU: tokens/s and batch-1 latency against HF continuous batching"),
    "cpu": ("cpu", "CPU: single stream, 32 concurrent, prefill and cold load against HF and llama.cpp"),
    "embeddings": ("embeddings", "sentences/s against sentence-transformers"),
    "langchain": ("langchain_chat", "ChatHearth.abatch against ChatHuggingFace.batch, 32 chats"),
}


def bench(args) -> None:
    module_name, _ = BENCHMARKS[args.benchmark]
    module = importlib.import_module(f"{__package__}.bench.{module_name}")  # heavy peers load only when asked
    sys.argv[0] = f"hearth-llm bench {args.benchmark}"  # what the benchmark's own usage line shows
    module.main(args.bench_argv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hearth-llm", description="In-process LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="a batch of chat prompts on the default model "
                                                     "(make demo runs the RAG and agent demo)")
    demo_parser.add_argument("--model", default="default")
    demo_parser.add_argument("--max-tokens", type=int, default=64)
    demo_parser.set_defaults(run=demo)
    chat_parser = commands.add_parser("chat", help="interactive chat with streamed answers")
    chat_parser.add_argument("--model", default="default")
    chat_parser.add_argument("--max-tokens", type=int, default=256)
    chat_parser.add_argument("--temperature", type=float, default=0.0)
    chat_parser.set_defaults(run=chat)
    info_parser = commands.add_parser("info", help="model, dtype, device and KV cache capacity")
    info_parser.add_argument("--model", default="default")
    info_parser.set_defaults(run=info)
    generate_parser = commands.add_parser("generate", help="prompts (one per line) to JSONL")
    generate_parser.add_argument("input", nargs="?", default="-")
    generate_parser.add_argument("-o", "--output", default="-")
    generate_parser.add_argument("--model", default="default")
    generate_parser.add_argument("--max-tokens", type=int, default=128)
    generate_parser.add_argument("--temperature", type=float, default=0.0)
    generate_parser.add_argument("--chat", action="store_true", help="wrap each line in the chat template")
    generate_parser.set_defaults(run=generate)
    bench_parser = commands.add_parser(
        "bench", help="benchmarks against peers (the README's comparison numbers)",
        description="Benchmarks; arguments after the name go to it (hearth-llm bench cpu --help).")
    benchmarks = bench_parser.add_subparsers(dest="benchmark", required=True)
    for name, (_, summary) in BENCHMARKS.items():
        # No options of its own: --help and the rest reach the benchmark's parser untouched.
        benchmarks.add_parser(name, help=summary, add_help=False)
    bench_parser.set_defaults(run=bench)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_argv = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.run(args)


if __name__ == "__main__":
    main()
