"""Decoder embedding models (the Qwen3-Embedding shape) and LLM rerankers (the Qwen3-Reranker
shape) on the LLM engine's own model code, against independent references on tiny random Qwen3
models, fp32:

* embeddings: sentence-transformers loading the same directory (Transformer → Pooling(lasttoken)
  → Normalize, prompts; its tokenizer pads on the left, as Qwen3-Embedding's does), and the model
  card's recipe (HF ``AutoModel``, left padding, the last position), within 1e-5;
* reranker scores: HF ``AutoModelForCausalLM`` on Qwen3-Reranker's model-card recipe (prompt
  around the pair, left padding, softmax over the "no"/"yes" logits at the last position).

The tokenizer is a byte-level BPE with Qwen's special tokens and "yes"/"no" as single tokens, so
every character of the prompts reaches the model.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config
from transformers.convert_slow_tokenizer import bytes_to_unicode

from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine, read_encoder_spec
from hearth_llm.embeddings.decoder import rerank_text
from hearth_llm.engine.pooling import DecoderPooler

st = pytest.importorskip("sentence_transformers")
from sentence_transformers.sentence_transformer import modules as st_modules  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
MERGES = [("y", "e"), ("ye", "s"), ("n", "o"), ("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e")]
TEXTS = ["a short one", "a somewhat longer text, with more words in it than the others have", "x",
         "Numbers 3.14159 and dates 2024-01-01, then a long tail of words " * 3, "Ünïcödé and 中文字符 too"]
QUERY = "where does the kettle switch itself off?"
DOCUMENTS = ["The kettle switches itself off when the water boils.", "Paris is the capital of France.", "x",
             "A long document about kettles, water, steam and the thermostat that ends it all. " * 4, "yes"]
# Qwen3-Reranker's model card, copied here (not imported) so that the reference is independent.
CARD_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
               "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def qwen_like_tokenizer(ends_with_eos: bool) -> PreTrainedTokenizerFast:
    """Byte-level BPE over all 256 bytes plus a few merges ("yes", "no", " the"); Qwen's special
    tokens; ``ends_with_eos`` appends ``<|endoftext|>`` to every text (Qwen3-Embedding's tokenizer)."""
    alphabet = list(bytes_to_unicode().values())
    vocab = {token: i for i, token in enumerate(SPECIAL + alphabet + ["".join(pair) for pair in MERGES])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL])
    if ends_with_eos:
        backend.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                               special_tokens=[("<|endoftext|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   padding_side="left")


def tiny_qwen3(seed: int) -> AutoModelForCausalLM:
    config = Qwen3Config(vocab_size=280, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.25)          # peaked attention: every token's position matters
            else:
                param.add_(0.2 * torch.randn_like(param))    # norms off one, so a missing q/k norm shows
    return model.eval()


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory):
    """As sentence-transformers saves Qwen3-Embedding: the bare Qwen3Model's weights (no ``model.``
    prefix, no lm_head), lasttoken pooling, Normalize, a query prompt."""
    root = tmp_path_factory.mktemp("qwen3_embedding")
    tiny_qwen3(seed=1).save_pretrained(root / "raw")
    qwen_like_tokenizer(ends_with_eos=True).save_pretrained(root / "raw")
    transformer = st_modules.Transformer(str(root / "raw"), max_seq_length=128)
    modules = [transformer, st_modules.Pooling(32, pooling_mode="lasttoken"), st_modules.Normalize()]
    st.SentenceTransformer(modules=modules, prompts={"query": QUERY_PROMPT, "document": ""},
                           device="cpu").save(str(root / "st"))
    return root / "st"


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    """Qwen3-Reranker's shape: a plain Qwen3ForCausalLM directory, its own lm_head."""
    path = tmp_path_factory.mktemp("qwen3_reranker")
    tiny_qwen3(seed=2).save_pretrained(path)
    qwen_like_tokenizer(ends_with_eos=False).save_pretrained(path)
    return path


def ours(path, texts, **options) -> torch.Tensor:
    kwargs = {key: options.pop(key) for key in ("prompt_name",) if key in options}
    with EmbeddingEngine(EmbeddingConfig(model=str(path), dtype="float32", show_progress=False, max_batch_size=3,
                                         **options)) as engine:
        assert engine.implementation == "hearth"
        return engine.embed(texts, **kwargs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    assert actual.shape == expected.shape
    assert F.cosine_similarity(actual, expected, dim=1).min().item() >= 0.99999
    assert torch.allclose(actual, expected, atol=atol), (actual - expected).abs().max()


def model_card_embeddings(path, texts: list[str]) -> torch.Tensor:
    """Qwen3-Embedding's model card: left-padded batch through ``AutoModel``, the last position."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), padding_side="left")
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    assert (batch["attention_mask"][:, 0] == 0).any()         # padded on the left indeed
    with torch.no_grad():
        return F.normalize(model(**batch).last_hidden_state[:, -1], dim=-1)


# ---- embeddings ------------------------------------------------------------------------------

def test_decoder_embeddings_match_sentence_transformers_with_prompts(embedding_dir):
    spec = read_encoder_spec(str(embedding_dir))
    assert spec.is_decoder and spec.pooling == "lasttoken" and spec.normalize
    reference = st.SentenceTransformer(str(embedding_dir), device="cpu")
    assert reference.tokenizer.padding_side == "left"
    assert_close(ours(embedding_dir, TEXTS), reference.encode(TEXTS, convert_to_tensor=True))
    queries = ours(embedding_dir, TEXTS, prompt_name="query")
    assert_close(queries, reference.encode_query(TEXTS, convert_to_tensor=True))
    assert F.cosine_similarity(queries, ours(embedding_dir, TEXTS)).max() < 0.999      # the prompt is there


def test_decoder_embeddings_match_the_model_card_recipe_in_batches_of_mixed_lengths(embedding_dir):
    """Batches of three (max_batch_size=3) of very different lengths: each row's own last token."""
    expected = model_card_embeddings(embedding_dir, TEXTS)
    assert_close(ours(embedding_dir, TEXTS), expected)
    for text, row in zip(TEXTS, expected):                    # alone equals batched
        assert_close(ours(embedding_dir, [text]), row[None])


def test_matryoshka_dimensions_and_the_causal_lm_architecture_name(embedding_dir, tmp_path):
    """Qwen3-Embedding's hub config says Qwen3ForCausalLM over the bare model's weights."""
    import shutil

    path = tmp_path / "hub"
    shutil.copytree(embedding_dir, path)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Model"]
    config["architectures"] = ["Qwen3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    expected = model_card_embeddings(embedding_dir, TEXTS)
    assert_close(ours(path, TEXTS, dimensions=8), F.normalize(expected[:, :8], dim=-1))


def test_pooler_returns_hidden_states_after_the_final_norm_and_keeps_no_cache(embedding_dir):
    pooler = DecoderPooler.from_pretrained(embedding_dir, torch.device("cpu"), torch.float32)
    model = AutoModel.from_pretrained(str(embedding_dir), dtype=torch.float32).eval()
    sequences = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [30], [40, 41, 42]]
    hidden, bounds = pooler.hidden_states(sequences)
    assert bounds == [0, 18, 19, 22]
    for ids, start, end in zip(sequences, bounds, bounds[1:]):
        with torch.no_grad():
            expected = model(torch.tensor([ids])).last_hidden_state[0]
        assert torch.allclose(hidden[start:end], expected, atol=1e-5)
    assert not any(isinstance(value, torch.Tensor) and value.dim() == 4 for value in vars(pooler).values())
    with pytest.raises(ValueError, match=r"token_ids\[1\] is empty"):
        pooler.hidden_states([[1], []])


# ---- LLM reranker ------------------------------------------------------------------------------

def model_card_scores(path, query: str, documents: list[str], instruction: str | None = None) -> torch.Tensor:
    """Qwen3-Reranker's model card: prompt tokens around the tokenized pair, left padding, softmax
    over the "no"/"yes" logits at the last position."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prefix = tokenizer.encode(CARD_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(CARD_SUFFIX, add_special_tokens=False)
    pairs = [f"<Instruct>: {instruction or 'Given a web search query, retrieve relevant passages that answer the query'}"
             f"\n<Query>: {query}\n<Document>: {document}" for document in documents]
    inputs = tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=512 - len(prefix) - len(suffix))
    inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
    batch = tokenizer.pad(inputs, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits[:, -1]
    no_yes = torch.stack([logits[:, tokenizer.convert_tokens_to_ids("no")],
                          logits[:, tokenizer.convert_tokens_to_ids("yes")]], dim=1)
    return torch.log_softmax(no_yes, dim=1)[:, 1].exp()


def reranker(path, **options) -> EmbeddingEngine:
    return EmbeddingEngine(EmbeddingConfig(model=str(path), task="score", dtype="float32", max_seq_length=512,
                                           max_batch_size=2, show_progress=False, **options))


def test_llm_reranker_scores_match_the_model_card_recipe(reranker_dir):
    expected = model_card_scores(reranker_dir, QUERY, DOCUMENTS)
    with reranker(reranker_dir) as engine:
        assert engine.is_reranker and engine.spec.is_llm_reranker
        scores = torch.tensor(engine.score(QUERY, DOCUMENTS))
        instructed = torch.tensor(engine.score(QUERY, DOCUMENTS, instruction="Find kettle facts"))
    assert torch.allclose(scores, expected, atol=1e-5), (scores - expected).abs().max()
    assert scores.max() - scores.min() > 100 * 1e-5           # the documents are told apart
    assert torch.allclose(instructed, model_card_scores(reranker_dir, QUERY, DOCUMENTS, "Find kettle facts"),
                          atol=1e-5)
    assert (instructed - scores).abs().max() > 100 * 1e-5     # the instruction reaches the model


def test_llm_reranker_prompt_wraps_the_pair():
    text = rerank_text("q?", "d.")
    assert text == ("<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
                    "<Query>: q?\n<Document>: d.")


def test_a_causal_lm_without_pooling_or_task_is_refused_naming_both(reranker_dir):
    with pytest.raises(ValueError, match="names no pooling.*task='score'"):
        EmbeddingEngine(EmbeddingConfig(model=str(reranker_dir)))
    with pytest.raises(ValueError, match="instruction applies to an LLM reranker"):
        import test_rerank
        path = test_rerank.write_reranker(reranker_dir.parent / "bert_reranker")
        with EmbeddingEngine(EmbeddingConfig(model=str(path))) as engine:
            engine.score("q", ["d"], instruction="x")


def test_rerankers_in_the_integrations_pick_the_llm_reranker(reranker_dir):
    from langchain_core.documents import Document

    from hearth_llm.integrations.langchain import HearthReranker

    expected = model_card_scores(reranker_dir, QUERY, DOCUMENTS)
    compressor = HearthReranker(model=str(reranker_dir), top_n=2,
                                engine_kwargs={"dtype": "float32", "max_seq_length": 512})
    kept = compressor.compress_documents([Document(page_content=text) for text in DOCUMENTS], QUERY)
    best = expected.argsort(descending=True)[:2].tolist()
    assert [doc.page_content for doc in kept] == [DOCUMENTS[i] for i in best]
    assert abs(kept[0].metadata["relevance_score"] - expected[best[0]].item()) < 1e-5
