"""32 LangChain chats on SmolLM2: ``ChatHearth.abatch`` against ``ChatHuggingFace`` over
``HuggingFacePipeline`` (same weights, same process, greedy, same token budget).

    python -m hearth_llm.benchmarks.langchain_chat [--num-chats 32] [--max-tokens 64] [--skip-hf]

Needs ``langchain-huggingface`` (``pip install --no-deps langchain-huggingface`` keeps its optional
sentence-transformers and CUDA wheels out). The HF model is built from our loader's dequantized
GGUF state dict, so both sides run exactly the same fp32 weights.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import torch

TOPICS = ["autumn leaves", "a lighthouse", "the moon", "a lost key", "coffee", "a mountain trail", "rain on a roof",
          "a city at night", "a friendly robot", "the ocean", "a library", "a thunderstorm", "a garden", "trains",
          "a snowy village", "a campfire", "a violin", "the desert", "a bakery", "fireflies", "a river",
          "an old map", "a clock tower", "honeybees", "a market", "a shipwreck", "the northern lights", "a kite",
          "a chess game", "a bicycle", "a volcano", "a paper boat"]


def conversations(num_chats: int) -> list[list[tuple[str, str]]]:
    return [[("human", f"Write a short poem about {TOPICS[i % len(TOPICS)]}.")] for i in range(num_chats)]


def run_hearth(chats, max_tokens: int) -> tuple[float, int, str]:
    from hearth_llm.integrations.langchain import ChatHearth

    chat = ChatHearth(model="default", temperature=0, max_tokens=max_tokens)
    chat.invoke("Hi", max_tokens=2)  # load the model outside the timing
    started = time.perf_counter()
    messages = asyncio.run(chat.abatch(chats))
    elapsed = time.perf_counter() - started
    return elapsed, sum(m.usage_metadata["output_tokens"] for m in messages), messages[0].content


def run_engine_alone(chats, max_tokens: int) -> tuple[float, int]:
    """The same chats straight into the shared engine: what the LangChain layer costs on top."""
    from hearth_llm.engine import ChatPrompt, SamplingParams, get_engine

    core = get_engine("default", show_progress=False)
    prompts = [ChatPrompt([{"role": "user", "content": text} for _, text in chat]) for chat in chats]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    started = time.perf_counter()
    streams = core.add_requests(prompts, [params] * len(prompts))
    num_tokens = sum(len(out.delta_token_ids) for stream in streams for out in stream)
    return time.perf_counter() - started, num_tokens


def build_hf_chat(max_tokens: int):
    from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
    from transformers import pipeline

    from .hf_peer import default_model_in_transformers

    model, tokenizer = default_model_in_transformers()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, max_new_tokens=max_tokens,
                         do_sample=False, return_full_text=False)
    llm = HuggingFacePipeline(pipeline=generator, model_id="SmolLM2-135M-Instruct")
    return ChatHuggingFace(llm=llm, tokenizer=tokenizer), tokenizer


def run_hf(chats, max_tokens: int) -> tuple[float, int, str]:
    chat, tokenizer = build_hf_chat(max_tokens)
    chat.invoke("Hi")  # warm up outside the timing
    started = time.perf_counter()
    messages = chat.batch(chats)  # its abatch raises NotImplementedError
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(tokenizer.encode(m.content, add_special_tokens=False)) for m in messages)
    return elapsed, num_tokens, messages[0].content


def report(label: str, seconds: float, num_tokens: int, note: str = "") -> None:
    print(f"{label:<44} {seconds:7.1f} s  {num_tokens:5d} tokens  {num_tokens / seconds:6.1f} tok/s  {note}".rstrip())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-chats", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="time ChatHearth only")
    args = parser.parse_args(argv)
    chats = conversations(args.num_chats)
    print(f"{args.num_chats} chats x up to {args.max_tokens} tokens, greedy, torch threads={torch.get_num_threads()}")
    hearth_s, hearth_tokens, hearth_sample = run_hearth(chats, args.max_tokens)
    report("ChatHearth.abatch", hearth_s, hearth_tokens)
    print(f"  first answer: {hearth_sample.strip()[:100]!r}")
    engine_s, engine_tokens = run_engine_alone(chats, args.max_tokens)
    report("engine alone (EngineCore.add_requests)", engine_s, engine_tokens, "(prompts prefix-cached by now)")
    if args.skip_hf:
        return
    hf_s, hf_tokens, hf_sample = run_hf(chats, args.max_tokens)
    report("ChatHuggingFace(HuggingFacePipeline).batch", hf_s, hf_tokens)
    print(f"  first answer: {hf_sample.strip()[:100]!r}")
    print(f"ChatHearth.abatch is {hf_s / hearth_s:.1f}x faster than ChatHuggingFace.batch "
          f"({hf_s:.1f} s / {hearth_s:.1f} s)")


if __name__ == "__main__":
    main()
