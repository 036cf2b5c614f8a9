"""Embedding throughput: HearthEmbeddings against LangChain's HuggingFaceEmbeddings
(sentence-transformers) on the same model in the same run, then 64 concurrent ``aembed_query`` calls.

    python -m hearth_llm.benchmarks.embeddings                 # 1000 sentences, 3 rounds each
    python -m hearth_llm.benchmarks.embeddings --num-sentences 2000 --rounds 5 --json out.json

The two sides alternate round by round, and which goes first alternates too (ST, ours, ours, ST,
...), so that load from other processes hits both alike; ``speedup`` is the median over rounds of
ours / theirs within the round, and the load average is printed before and after. Sentences per
CPU-second (all threads of this process) are reported too: on a shared machine they move much
less than wall-clock rates. The baseline needs ``pip install sentence-transformers`` and
``pip install --no-deps langchain-huggingface`` (its own pins would downgrade huggingface_hub);
without them only our side runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import torch

from hearth_llm.embeddings import default_model_path
from hearth_llm.integrations.langchain import HearthEmbeddings


def make_sentences(count: int, seed: int = 0) -> list[str]:
    """Deterministic sentences of 4–40 words (7–43 tokens, 25 on average) drawn from the model's vocabulary."""
    vocab = (default_model_path() / "vocab.txt").read_text(encoding="utf-8").split("\n")
    words = [word for word in vocab[2000:] if word.isalpha() and len(word) > 2]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 40))).capitalize() + "."
            for _ in range(count)]


def sentence_transformers_baseline(model_path: str):
    try:
        from langchain_huggingface import HuggingFaceEmbeddings
    except ImportError as error:
        print(f"baseline skipped: {error}")
        return None
    # sentence-transformers' own defaults: batches of 32 sorted by length, normalization by the model.
    return HuggingFaceEmbeddings(model_name=model_path, model_kwargs={"device": "cpu"})


def time_round(embed, sentences: list[str]) -> tuple[float, float, list[list[float]]]:
    """Sentences per second of wall clock and per CPU-second, and the vectors."""
    start, start_cpu = time.perf_counter(), time.process_time()
    vectors = embed(sentences)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return len(sentences) / wall, len(sentences) / cpu, vectors


def min_cosine(ours: list[list[float]], theirs: list[list[float]]) -> float:
    a, b = torch.tensor(ours), torch.tensor(theirs)
    return torch.nn.functional.cosine_similarity(a, b, dim=1).min().item()


async def concurrent_queries(embeddings: HearthEmbeddings, queries: list[str]) -> dict:
    engine = embeddings.engine
    before = engine.stats()
    start = time.perf_counter()
    await asyncio.gather(*(embeddings.aembed_query(query) for query in queries))
    seconds = time.perf_counter() - start
    after = engine.stats()
    return {"num_calls": len(queries), "num_batches": after["num_batches"] - before["num_batches"],
            "num_steps": after["num_steps"] - before["num_steps"], "seconds": round(seconds, 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-queries", type=int, default=64)
    parser.add_argument("--num-workers", type=int, help="EmbeddingConfig.num_workers (default: one per core)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    sentences = make_sentences(args.num_sentences)
    model_path = str(default_model_path())
    engine_kwargs = {} if args.num_workers is None else {"num_workers": args.num_workers}
    ours = HearthEmbeddings(show_progress=False, engine_kwargs=engine_kwargs)
    theirs = sentence_transformers_baseline(model_path)
    ours.embed_documents(sentences[:64])            # load and warm up both before timing
    if theirs is not None:
        theirs.embed_documents(sentences[:64])

    sides = {"hearth": ours.embed_documents}
    if theirs is not None:
        sides["sentence_transformers"] = theirs.embed_documents
    rates: dict[str, list[float]] = {name: [] for name in sides}
    cpu_rates: dict[str, list[float]] = {name: [] for name in sides}
    vectors = {}
    load_before = os.getloadavg()
    for round_index in range(args.rounds):
        for name in (reversed(sides) if round_index % 2 == 0 else sides):
            rate, cpu_rate, vectors[name] = time_round(sides[name], sentences)
            rates[name].append(rate)
            cpu_rates[name].append(cpu_rate)

    result = {"num_sentences": len(sentences), "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
              "load_average_before": [round(load, 2) for load in load_before],
              "load_average_after": [round(load, 2) for load in os.getloadavg()],
              "implementation": ours.engine.implementation, "precision": ours.engine.precision,
              "max_batch_tokens": ours.engine.config.batch_token_budget,
              "num_workers": ours.engine.num_workers,
              "hearth_sentences_per_s": round(statistics.median(rates["hearth"]), 1),
              "hearth_rounds": [round(rate, 1) for rate in rates["hearth"]],
              "hearth_sentences_per_cpu_s": round(statistics.median(cpu_rates["hearth"]), 1)}
    if theirs is not None:
        baseline = statistics.median(rates["sentence_transformers"])
        round_speedups = [a / b for a, b in zip(rates["hearth"], rates["sentence_transformers"], strict=True)]
        result.update(sentence_transformers_sentences_per_s=round(baseline, 1),
                      sentence_transformers_rounds=[round(rate, 1) for rate in rates["sentence_transformers"]],
                      sentence_transformers_sentences_per_cpu_s=round(
                          statistics.median(cpu_rates["sentence_transformers"]), 1),
                      speedup=round(statistics.median(round_speedups), 2),
                      speedup_rounds=[round(speedup, 2) for speedup in round_speedups],
                      speedup_per_cpu_s=round(statistics.median(cpu_rates["hearth"])
                                              / statistics.median(cpu_rates["sentence_transformers"]), 2),
                      min_cosine=min_cosine(vectors["hearth"], vectors["sentence_transformers"]))
    result["concurrent_queries"] = asyncio.run(concurrent_queries(ours, sentences[:args.num_queries]))
    result["engine_stats"] = ours.engine.stats()

    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=2)
    return result


if __name__ == "__main__":
    main()
