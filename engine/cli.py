"""The engine's commands of ``hearth-llm``: ``demo``, ``chat``, ``info``, ``generate``.

``bench`` lives in ``hearth_llm.benchmarks.cli``; ``hearth_llm.cli`` puts both behind one script, so the
engine never imports the benchmarks (they import the integrations).
"""
from __future__ import annotations

import argparse
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
    from .memory import memory_report

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
                     "priorities", "seeded-sampling", "logprobs", "stop-strings", "memory-budget", "sleep-mode"],
        # each device's budget and every engine's share of it (here: this command's engine)
        "memory": memory_report(),
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


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``hearth-llm`` parser with the engine's commands, and its subcommand table for more.

    >>> parser, commands = build_parser()
    >>> parser.parse_args(["info"]).command
    'info'
    """
    parser = argparse.ArgumentParser(prog="hearth-llm", description="In-process LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_commands(commands)
    return parser, commands


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Adds ``demo``, ``chat``, ``info`` and ``generate`` to a ``hearth-llm`` subcommand table."""
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
    info_parser = commands.add_parser("info", help="model, dtype, device, KV cache capacity and memory budget")
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


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> None:
    """Parses ``argv`` and runs the chosen command. A command that sets ``forwards_unknown_args``
    (``bench``) gets the arguments it does not know as ``args.forwarded_argv``; any other refuses them."""
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "forwards_unknown_args", False):
        args.forwarded_argv = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.run(args)


def main(argv: list[str] | None = None) -> None:
    """The engine's commands alone; the ``hearth-llm`` script (``hearth_llm.cli``) adds ``bench``."""
    parser, _ = build_parser()
    run(parser, argv)


if __name__ == "__main__":
    main()
