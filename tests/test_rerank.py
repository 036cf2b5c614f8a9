"""Cross-encoder rerankers (BERT and XLM-R sequence-classification heads, num_labels 1) against
sentence-transformers' ``CrossEncoder`` on tiny random models, fp32: scores within 1e-4."""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from transformers import AutoModelForSequenceClassification, BertConfig, XLMRobertaConfig

from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine, default_model_path, read_encoder_spec

st = pytest.importorskip("sentence_transformers")

QUERY = "where does the kettle switch itself off?"
DOCUMENTS = ["The kettle switches itself off when the water boils.", "Paris is the capital of France.", "x",
             "A very long document about kettles, water, steam and the thermostat that ends it all. " * 12,
             "Ünïcödé and 中文字符 documents are scored too.", "kettle"]
COMMON = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
              num_labels=1)


def write_reranker(path, kind: str = "bert", activation: str | None = None):
    torch.manual_seed(5)
    if kind == "bert":
        config = BertConfig(**COMMON, max_position_embeddings=128, pad_token_id=0, type_vocab_size=2)
    else:
        config = XLMRobertaConfig(**COMMON, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and "embeddings" not in name:
                param.normal_(0, 0.2)       # big enough that the documents' tokens move the first vector
            if "token_type" in name:
                param.normal_(0, 0.3)       # token types must matter to BERT's scores
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_path() / name, path / name)
    if kind != "bert":      # as XLM-R's tokenizer: no token types (the copied BERT tokenizer would add them)
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        tokenizer_config["model_input_names"] = ["input_ids", "attention_mask"]
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if activation is not None:
        saved = json.loads((path / "config.json").read_text())
        saved["sentence_transformers"] = {"activation_fn": activation}
        (path / "config.json").write_text(json.dumps(saved))
    return path


def reference_scores(path, query: str, documents: list[str], max_length: int = 64) -> torch.Tensor:
    model = st.CrossEncoder(str(path), device="cpu", max_length=max_length)
    return torch.tensor(model.predict([(query, document) for document in documents]), dtype=torch.float32)


def reranker(path, **options) -> EmbeddingEngine:
    return EmbeddingEngine(EmbeddingConfig(model=str(path), implementation="hearth", dtype="float32",
                                           max_seq_length=64, show_progress=False, **options))


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_scores_match_sentence_transformers_cross_encoder(tmp_path, kind):
    path = write_reranker(tmp_path, kind)
    expected = reference_scores(path, QUERY, DOCUMENTS)
    with reranker(path) as engine:
        assert engine.is_reranker and engine.implementation == "hearth"
        scores = torch.tensor(engine.score(QUERY, DOCUMENTS))
    assert scores.shape == (len(DOCUMENTS),)
    assert torch.allclose(scores, expected, atol=1e-4), (scores - expected).abs().max()
    assert scores.max() - scores.min() > 10 * 1e-4       # the documents are told apart, well beyond the tolerance


def test_transformers_implementation_scores_alike(tmp_path):
    path = write_reranker(tmp_path, "bert")
    expected = reference_scores(path, QUERY, DOCUMENTS)
    with EmbeddingEngine(EmbeddingConfig(model=str(path), implementation="transformers", max_seq_length=64)) as engine:
        assert torch.allclose(torch.tensor(engine.score(QUERY, DOCUMENTS)), expected, atol=1e-4)


def test_bert_pairs_carry_token_types(tmp_path):
    """Dropping the document's token type 1 moves the scores: the check above would catch it."""
    path = write_reranker(tmp_path, "bert")
    with reranker(path) as engine:
        scores = torch.tensor(engine.score(QUERY, DOCUMENTS))
        runner = engine._runner
        original = runner.model.forward
        runner.model.forward = lambda ids, mask, types=None: original(ids, mask, None)
        try:
            without_types = torch.tensor(engine.score(QUERY, DOCUMENTS))
        finally:
            runner.model.forward = original
    assert (scores - without_types).abs().max() > 1e-3


@pytest.mark.parametrize("activation", ["torch.nn.modules.linear.Identity", "torch.nn.modules.activation.Sigmoid"])
def test_the_activation_named_in_the_config_is_applied(tmp_path, activation):
    path = write_reranker(tmp_path, "xlm-roberta", activation=activation)
    expected = reference_scores(path, QUERY, DOCUMENTS)
    with reranker(path) as engine:
        scores = torch.tensor(engine.score(QUERY, DOCUMENTS))
    assert torch.allclose(scores, expected, atol=1e-4)
    config = json.loads(path.joinpath("config.json").read_text())
    config.pop("sentence_transformers")
    path.joinpath("config.json").write_text(json.dumps(config))
    with reranker(path) as engine:          # no activation named: Sigmoid, sentence-transformers' default
        default = torch.tensor(engine.score(QUERY, DOCUMENTS))
    assert torch.allclose(default, torch.sigmoid(scores) if activation.endswith("Identity") else scores, atol=1e-6)


def test_an_unsupported_activation_is_refused_naming_it(tmp_path):
    path = write_reranker(tmp_path, "bert", activation="my_package.Softplus")
    with pytest.raises(ValueError, match="activation_fn 'my_package.Softplus' is not supported"):
        read_encoder_spec(str(path))


def test_more_than_one_label_is_refused(tmp_path):
    path = write_reranker(tmp_path, "bert")
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_labels 1"):
        read_encoder_spec(str(path))


async def test_async_scores_equal_sync_and_concurrent_queries_share_batches(tmp_path):
    path = write_reranker(tmp_path, "bert")
    with reranker(path) as engine:
        expected = [engine.score(f"{QUERY} {i}", DOCUMENTS) for i in range(8)]
        before = engine.stats()["num_batches"]
        results = await asyncio.gather(*(engine.ascore(f"{QUERY} {i}", DOCUMENTS) for i in range(8)))
        num_batches = engine.stats()["num_batches"] - before
    assert num_batches < 8
    for got, want in zip(results, expected, strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)


def test_an_overlong_pair_is_truncated_or_refused(tmp_path):
    path = write_reranker(tmp_path, "bert")
    with reranker(path) as engine:
        assert len(engine.score(QUERY, DOCUMENTS[3:4])) == 1
        with pytest.raises(ValueError, match="max_seq_length"):
            engine.score(QUERY, DOCUMENTS[3:4], truncate=False)


def test_reranker_and_embedder_refuse_each_others_calls(tmp_path):
    path = write_reranker(tmp_path, "bert")
    with reranker(path) as engine:
        with pytest.raises(ValueError, match="is a cross-encoder"):
            engine.embed(["x"])
    with EmbeddingEngine(EmbeddingConfig()) as embedder:
        with pytest.raises(ValueError, match="is not a cross-encoder"):
            embedder.score("q", ["d"])


@pytest.mark.parametrize("args, error, message", [(("q", []), ValueError, "documents must be a non-empty list"),
                                                  (("q", "doc"), TypeError, "documents must be a list of str"),
                                                  ((3, ["d"]), TypeError, "query must be a str")])
def test_bad_score_input_is_refused_naming_the_argument(tmp_path, args, error, message):
    path = write_reranker(tmp_path, "bert")
    with reranker(path) as engine:
        with pytest.raises(error, match=message):
            engine.score(*args)
