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
from embedding_dirs import write_cross_encoder, write_qwen3_embedding, write_qwen3_reranker
from transformers import AutoModel, AutoModelForCausalLM

from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine, read_encoder_spec
from hearth_llm.embeddings.decoder import rerank_text
from hearth_llm.engine.pooling import DecoderPooler

TEXTS = ["a short one", "a somewhat longer text, with more words in it than the others have", "x",
         "Numbers 3.14159 and dates 2024-01-01, then a long tail of words " * 3, "Ünïcödé and 中文字符 too"]
QUERY = "where does the kettle switch itself off?"
DOCUMENTS = ["The kettle switches itself off when the water boils.", "Paris is the capital of France.", "x",
             "A long document about kettles, water, steam and the thermostat that ends it all. " * 4, "yes"]
# Qwen3-Reranker's model card, copied here (not imported) so that the reference is independent.
CARD_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
               "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory):
    return write_qwen3_embedding(tmp_path_factory.mktemp("qwen3_embedding"),
                                 prompts={"query": QUERY_PROMPT, "document": ""})


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return write_qwen3_reranker(tmp_path_factory.mktemp("qwen3_reranker"))


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
    st = pytest.importorskip("sentence_transformers")
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
    pairs = [f"<Instruct>: {instruction or CARD_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
             for document in documents]
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
    path = write_cross_encoder(reranker_dir.parent / "cross_encoder")
    with EmbeddingEngine(EmbeddingConfig(model=str(path), task="score")) as engine:
        with pytest.raises(ValueError, match="instruction applies to an LLM reranker"):
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


def test_hearth_embeddings_and_hearth_embedding_serve_a_decoder_embedder_with_its_prompts(embedding_dir):
    from hearth_llm.integrations.langchain import HearthEmbeddings
    from hearth_llm.integrations.llama_index import HearthEmbedding

    queries = model_card_embeddings(embedding_dir, [QUERY_PROMPT + text for text in TEXTS[:2]])
    documents = model_card_embeddings(embedding_dir, TEXTS[:2])          # the document prompt is ""
    options = {"dtype": "float32"}
    langchain = HearthEmbeddings(model=str(embedding_dir), engine_kwargs=options)
    assert_close(torch.tensor([langchain.embed_query(text) for text in TEXTS[:2]]), queries)
    assert_close(torch.tensor(langchain.embed_documents(TEXTS[:2])), documents)
    llama_index = HearthEmbedding(model_name=str(embedding_dir), engine_kwargs=options)
    assert_close(torch.tensor([llama_index.get_query_embedding(text) for text in TEXTS[:2]]), queries)
    assert_close(torch.tensor(llama_index.get_text_embedding_batch(TEXTS[:2])), documents)


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "mean_sqrt_len", "lasttoken"])
def test_pooling_unpadded_rows_equals_pooling_the_padded_batch(mode):
    from hearth_llm.embeddings.pooling import pool, pool_packed

    lengths, generator = [5, 1, 3, 7], torch.Generator().manual_seed(0)
    hidden = torch.randn(sum(lengths), 8, generator=generator)
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    padded, mask = torch.zeros(len(lengths), max(lengths), 8), torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, (start, length) in enumerate(zip(bounds, lengths)):
        padded[row, :length], mask[row, :length] = hidden[start:start + length], 1
    for normalize in (True, False):
        expected = pool(padded, mask, mode, normalize, dimensions=5)
        assert torch.allclose(pool_packed(hidden, bounds, mode, normalize, dimensions=5), expected, atol=1e-6)


def test_a_decoder_config_the_engine_refuses_names_the_field(reranker_dir, tmp_path):
    """A rope type the engine's model code does not implement: the LLM reranker refuses it by name
    when the engine is made; an embedder may fall back to transformers' AutoModel, or refuse by name
    under implementation='hearth'."""
    import shutil

    path = tmp_path / "dynamic_rope"
    shutil.copytree(reranker_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported"):
        EmbeddingEngine(EmbeddingConfig(model=str(path), task="score"))
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported"):
        EmbeddingEngine(EmbeddingConfig(model=str(path), pooling="lasttoken", implementation="hearth"))
    with EmbeddingEngine(EmbeddingConfig(model=str(path), pooling="lasttoken", dtype="float32")) as engine:
        assert engine.implementation == "transformers"
        assert engine.embed(["x y"]).shape == (1, 32)


def test_an_empty_text_without_tokens_fails_only_its_own_request(reranker_dir):
    """The reranker directory's tokenizer adds no end token: "" has no token to pool."""
    with EmbeddingEngine(EmbeddingConfig(model=str(reranker_dir), pooling="lasttoken", dtype="float32")) as engine:
        empty, fine = engine.submit(["a", ""]), engine.submit(["b"])
        with pytest.raises(ValueError, match=r"texts\[1\] cannot be tokenized.*no tokens"):
            empty.result(timeout=60)
        assert fine.result(timeout=60).shape == (1, 32)
