"""The embedding model: our encoder and pooling against independent references.

The default model (all-MiniLM-L6-v2) is checked against transformers' ``AutoModel`` with mean
pooling and normalization written out here, and against sentence-transformers when it is
installed. Tiny random BERT and RoBERTa directories check our encoder against transformers' for
each pooling mode, with and without padding.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer, BertConfig, RobertaConfig

from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine, default_model_path, read_encoder_spec
from hearth_llm.embeddings.bert import PackedLayout, packed_attention
from hearth_llm.embeddings.linear import Linear, reference_linear
from hearth_llm.embeddings.pooling import pool
from hearth_llm.embeddings import runner as runner_module

MIN_COSINE = 0.99999

TEXTS = [
    "The cat sat on the mat.",
    "Paris is the capital and most populous city of France.",
    "",
    "   leading and trailing spaces   ",
    "Numbers 3.14159 and 2,718 and dates 2024-01-01.",
    "Ünïcödé, emoji 🙂 and 中文字符 are tokenized too.",
    "A longer passage about rivers. " * 60,          # > 256 tokens: truncated like the reference
    "short",
]


@pytest.fixture(scope="module")
def default_engine():
    with EmbeddingEngine(EmbeddingConfig(show_progress=False)) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference_vectors():
    """transformers AutoModel + mean pooling + L2 normalization, the sentence-transformers recipe."""
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    encoded = tokenizer(TEXTS, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a, b, dim=1).min().item()


def test_default_model_is_read_from_its_sentence_transformers_directory():
    spec = read_encoder_spec("default")
    assert (spec.pooling, spec.normalize, spec.max_seq_length, spec.dimension) == ("mean", True, 256, 384)
    assert spec.model_type == "bert"


def test_default_engine_runs_our_encoder(default_engine):
    assert default_engine.implementation == "hearth"


def test_default_model_matches_the_transformers_reference(default_engine, reference_vectors):
    vectors = default_engine.embed(TEXTS)
    assert vectors.dtype == torch.float32 and vectors.shape == (len(TEXTS), 384)
    assert min_cosine(vectors, reference_vectors) >= MIN_COSINE
    assert torch.allclose(vectors.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_transformers_implementation_matches_the_reference_too(reference_vectors):
    with EmbeddingEngine(EmbeddingConfig(implementation="transformers", show_progress=False)) as engine:
        assert engine.implementation == "transformers"
        assert min_cosine(engine.embed(TEXTS), reference_vectors) >= MIN_COSINE


def test_default_model_matches_sentence_transformers(default_engine):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(default_model_path()), device="cpu")
    expected = torch.from_numpy(model.encode(TEXTS, batch_size=4))
    assert min_cosine(default_engine.embed(TEXTS), expected) >= MIN_COSINE


def test_a_text_embeds_the_same_alone_and_in_a_padded_batch(default_engine):
    alone = default_engine.embed_one("The cat sat on the mat.")
    batched = default_engine.embed(["The cat sat on the mat.", "A much longer sentence " * 20])[0]
    assert F.cosine_similarity(alone, batched, dim=0).item() >= MIN_COSINE


def test_packed_layout_groups_consecutive_texts_of_equal_length_into_runs():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    layout = PackedLayout.from_mask(mask)
    assert layout.runs == [(0, 2, 3), (6, 1, 4), (10, 1, 2), (12, 1, 3)]
    assert layout.token_index.tolist() == mask.flatten().nonzero().squeeze(1).tolist()


def test_layout_from_the_token_counts_equals_the_layout_from_the_mask():
    lengths = [3, 3, 4, 2, 3, 0]
    mask = (torch.arange(4)[None, :] < torch.tensor(lengths)[:, None]).long()
    from_mask, from_lengths = PackedLayout.from_mask(mask), PackedLayout.from_lengths(lengths, torch.device("cpu"))
    assert from_lengths.runs == from_mask.runs == [(0, 2, 3), (6, 1, 4), (10, 1, 2), (12, 1, 3)]
    assert from_lengths.token_index.tolist() == mask.flatten().nonzero().squeeze(1).tolist()
    assert from_lengths.cu_seqlens is None           # varlen attention is for CUDA only


def test_the_compiled_blocks_function_is_the_layers_second_half():
    from hearth_llm.embeddings.bert import BertConfig as OurBertConfig
    from hearth_llm.embeddings.bert import BertLayer
    from hearth_llm.embeddings.compiled_block import feed_forward_half

    torch.manual_seed(0)
    config = OurBertConfig(vocab_size=10, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=64, activation="gelu", max_position_embeddings=16, type_vocab_size=1,
                           layer_norm_eps=1e-12, position_offset=0)
    layer = BertLayer(config).eval()
    for parameter in layer.parameters():           # LayerNorm starts at ones/zeros: make it count
        parameter.data.normal_(0, 0.5)
    hidden, attended = torch.randn(7, 32), torch.randn(7, 32)
    with torch.no_grad():
        second = layer.attention_norm(hidden + layer.out_proj(attended))
        expected = layer.output_norm(second + layer.down_proj(layer.up_proj(second)))
        actual = feed_forward_half(hidden, attended, *layer._second_half_weights())
    assert torch.allclose(actual, expected, atol=1e-5), (actual - expected).abs().max()


def test_add_and_norm_is_the_layer_norm_of_the_sum_on_the_cpu():
    from hearth_llm.embeddings.bert import add_and_norm

    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(32, eps=1e-12)
    norm.weight.data.normal_(1, 0.5)
    norm.bias.data.normal_(0, 0.5)
    x, residual = torch.randn(7, 32), torch.randn(7, 32)
    with torch.no_grad():
        assert torch.equal(add_and_norm(x, residual, norm), norm(residual + x))


def test_compiled_blocks_stay_off_on_the_cpu(tmp_path):
    path = write_tiny_sentence_model(tmp_path)
    with EmbeddingEngine(EmbeddingConfig(model=str(path), dtype="float32")) as engine:
        engine.embed(["warm"])
        assert all(layer.compiled_half is None for layer in engine._runner.model.layers)


def test_truncating_tokenization_encodes_once_and_cuts_where_two_passes_did(tmp_path):
    path = write_tiny_sentence_model(tmp_path)                     # max_seq_length 64
    runner = runner_module.EncoderRunner(read_encoder_spec(str(path)), EmbeddingConfig(model=str(path)))
    texts = ["short text", "word " * 62, "word " * 63, "word " * 200]  # 12, 64, 65, 202 tokens untruncated
    calls = []
    encode = runner._encode
    runner._encode = lambda batch, max_length: calls.append(max_length) or encode(batch, max_length)
    ids, _ = runner.tokenize(texts, truncate=True)
    assert calls == [64]
    for text, row in zip(texts, ids, strict=True):
        untruncated = runner.tokenizer(text)["input_ids"]
        expected = untruncated if len(untruncated) <= 64 else untruncated[:63] + untruncated[-1:]
        assert row == expected
    _, is_too_long = runner.tokenize(texts, truncate=False)
    assert is_too_long == [False, False, True, True]


def test_an_unpadded_batch_is_one_run_without_an_index():
    layout = PackedLayout.from_mask(torch.ones(3, 5, dtype=torch.long))
    assert layout.runs == [(0, 3, 5)] and layout.token_index is None


def test_packed_attention_equals_masked_attention_on_the_padded_batch():
    torch.manual_seed(0)
    heads, head_dim = 4, 8
    lengths = [7, 7, 5, 9, 5, 5, 1]                   # unsorted, with repeats: several runs
    mask = (torch.arange(9)[None, :] < torch.tensor(lengths)[:, None]).long()
    padded_qkv = torch.randn(len(lengths), 9, 3, heads, head_dim)
    query, key, value = padded_qkv.permute(2, 0, 3, 1, 4)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.bool()[:, None, None, :])
    expected = expected.transpose(1, 2).reshape(len(lengths) * 9, heads * head_dim)
    layout = PackedLayout.from_mask(mask)
    actual = packed_attention(layout.pack(padded_qkv.reshape(len(lengths) * 9, -1)), layout, heads)
    assert torch.allclose(actual, layout.pack(expected), atol=1e-6)


def test_texts_embed_the_same_in_batches_of_many_equal_length_runs(default_engine):
    texts = [" ".join(["word"] * n) for n in (3, 9, 3, 1, 9, 9, 4, 3)]
    together = default_engine.embed(texts)
    alone = torch.stack([default_engine.embed_one(text) for text in texts])
    assert min_cosine(together, alone) >= MIN_COSINE


def test_onednn_linear_matches_the_torch_reference():
    torch.manual_seed(0)
    for activation in ("none", "gelu", "gelu_tanh", "relu"):
        layer = Linear(48, 96, activation=activation)
        x = torch.randn(7, 48)
        expected = reference_linear(x, layer.weight, layer.bias, activation)
        layer.prepack()
        assert torch.allclose(layer(x), expected, atol=1e-5), activation


def test_bf16_copy_of_a_float32_layer_takes_and_gives_float32_at_bf16_precision():
    torch.manual_seed(0)
    layer = Linear(48, 96, activation="gelu")
    x = torch.randn(7, 48)
    expected = reference_linear(x, layer.weight, layer.bias, "gelu")
    layer.prepack(with_bf16_copy=True)
    if not layer.has_bf16_copy:
        pytest.skip("no bf16 oneDNN matmuls on this CPU")
    fast = layer(x, in_bf16=True)
    assert fast.dtype == torch.float32
    assert not torch.allclose(fast, expected, atol=1e-5)                  # it did compute in bf16...
    assert torch.allclose(fast, expected, atol=0.05, rtol=0.02)           # ...at bf16's precision
    assert torch.allclose(layer(x), expected, atol=1e-5)                  # and the float32 path is kept


def test_default_dtype_on_a_bf16_cpu_is_mixed_precision_within_the_cosine_bar(default_engine, reference_vectors):
    if not _has_bf16_matmuls():
        pytest.skip("no bf16 oneDNN matmuls on this CPU")
    assert default_engine.precision == "mixed float32/bfloat16"
    long_texts = [text for text in TEXTS if len(text) > 20]
    with EmbeddingEngine(EmbeddingConfig(dtype="float32", show_progress=False)) as exact_engine:
        assert exact_engine.precision == "float32"
        exact = exact_engine.embed(long_texts)
    mixed = default_engine.embed(long_texts)
    assert not torch.allclose(mixed, exact, atol=1e-6)                   # the bf16 layers did run
    assert min_cosine(mixed, exact) >= MIN_COSINE


def test_texts_too_short_for_mixed_precision_embed_exactly_as_in_float32(default_engine):
    if default_engine.precision != "mixed float32/bfloat16":
        pytest.skip("no mixed precision on this CPU")
    short = ["ok", "yes", "x", "", "kettle"]                           # 2–3 tokens
    with EmbeddingEngine(EmbeddingConfig(dtype="float32", show_progress=False)) as exact_engine:
        exact = exact_engine.embed(short)
    # batched with long texts too: short texts get batches of their own
    mixed = default_engine.embed(["A much longer sentence about the weather " * 3, *short])[1:]
    assert torch.allclose(mixed, exact, atol=1e-6)


def test_mixed_precision_is_dropped_when_the_check_at_load_misses_the_bar(monkeypatch):
    monkeypatch.setattr(runner_module, "MIXED_PRECISION_MIN_COSINE", 1.5)    # no cosine reaches it
    with EmbeddingEngine(EmbeddingConfig(show_progress=False)) as engine:
        assert engine.precision == "float32"


def _has_bf16_matmuls() -> bool:
    layer = Linear(8, 8)
    layer.prepack(with_bf16_copy=True)
    return layer.has_bf16_copy


def test_mean_pooling_ignores_padding():
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [100.0, 100.0]]])
    pooled = pool(hidden, torch.tensor([[1, 1, 0]]), "mean", normalize=False)
    assert pooled.tolist() == [[2.0, 0.0]]


# ---- tiny random encoders of each supported kind, against transformers --------------------------

POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
                 "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens", "lasttoken": "pooling_mode_lasttoken"}


def write_tiny_sentence_model(path, model_type: str = "bert", pooling: str = "mean", normalize: bool = True):
    """A random 2-layer encoder with the default model's tokenizer, laid out as sentence-transformers does."""
    common = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=128)
    if model_type == "bert":
        config = BertConfig(**common, pad_token_id=0)
    else:
        config = RobertaConfig(**{**common, "max_position_embeddings": 130}, pad_token_id=1, type_vocab_size=1)
    torch.manual_seed(1)
    AutoModel.from_config(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_path() / name, path / name)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                 POOLING_FLAGS[pooling]: True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    return path


def transformers_embeddings(path, texts: list[str], pooling: str, normalize: bool) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()
    encoded = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        hidden = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).last_hidden_state
    return pool(hidden, encoded["attention_mask"], pooling, normalize)


@pytest.mark.parametrize("model_type, pooling", [("bert", "mean"), ("bert", "cls"), ("bert", "max"),
                                                 ("bert", "mean_sqrt_len"), ("bert", "lasttoken"),
                                                 ("roberta", "mean")])
def test_our_encoder_matches_transformers_on_tiny_models(tmp_path, model_type, pooling):
    path = write_tiny_sentence_model(tmp_path, model_type, pooling, normalize=pooling != "max")
    texts = ["a short one", "a somewhat longer text with more words in it", "x", "same length"]
    expected = transformers_embeddings(path, texts, pooling, normalize=pooling != "max")
    # float32 throughout: this checks the architecture; mixed precision is checked on its own below
    with EmbeddingEngine(EmbeddingConfig(model=str(path), implementation="hearth", dtype="float32")) as engine:
        actual = engine.embed(texts)
    assert torch.allclose(actual, expected, atol=1e-4), (actual - expected).abs().max()


def test_plain_hf_directory_means_mean_pooling_without_normalization(tmp_path):
    path = write_tiny_sentence_model(tmp_path)
    (path / "modules.json").unlink()
    spec = read_encoder_spec(str(path))
    assert (spec.pooling, spec.normalize) == ("mean", False)


def test_unsupported_module_is_refused_by_name(tmp_path):
    path = write_tiny_sentence_model(tmp_path)
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        read_encoder_spec(str(path))


def test_max_seq_length_beyond_the_position_embeddings_is_refused():
    with pytest.raises(ValueError, match="max_seq_length must be at most 512"):
        read_encoder_spec("default", max_seq_length=513)


def test_missing_model_directory_is_refused_by_name():
    with pytest.raises(ValueError, match="model must be 'default' or"):
        EmbeddingEngine(EmbeddingConfig(model="/no/such/model"))
