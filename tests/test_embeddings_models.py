"""Encoders beside BERT — XLM-RoBERTa (bge-m3, multilingual-e5), NomicBert (nomic-embed-text),
ModernBERT — on tiny random models, against sentence-transformers loading the same directory
(it runs transformers' own model code), fp32: cosine >= 0.99999 per text.

Each directory is written by sentence-transformers itself (Transformer → Pooling → Normalize),
so the modules.json / pooling / prompts files are the ones users download. The tokenizer is the
bundled MiniLM's for every model: the math under test does not depend on it.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from embedding_dirs import random_encoder

from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine, default_model_path, read_encoder_spec

st = pytest.importorskip("sentence_transformers")
from sentence_transformers.sentence_transformer import modules as st_modules  # noqa: E402

MIN_COSINE = 0.99999
TEXTS = ["a short one", "a somewhat longer text with more words in it than the others have", "x",
         "same length", "Numbers 3.14159 and dates 2024-01-01, then a long tail of words to pass a window " * 2,
         "Ünïcödé and 中文字符 too"]


def write_model(path, kind: str, pooling: str = "mean", normalize: bool = True, prompts: dict | None = None,
                default_prompt_name: str | None = None):
    """A random encoder of ``kind`` saved by sentence-transformers with the given pipeline."""
    raw = path / "raw"
    random_encoder(kind).save_pretrained(raw)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_path() / name, raw / name)
    transformer = st_modules.Transformer(str(raw), max_seq_length=64)
    modules = [transformer, st_modules.Pooling(32, pooling_mode=pooling)]
    if normalize:
        modules.append(st_modules.Normalize())
    st.SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default_prompt_name,
                           device="cpu").save(str(path / "st"))
    return path / "st"


def reference(path, texts, **kwargs) -> torch.Tensor:
    model = st.SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, convert_to_tensor=True, **kwargs).float()


def ours(path, texts, **kwargs) -> torch.Tensor:
    options = {key: kwargs.pop(key) for key in ("dimensions", "pooling") if key in kwargs}
    with EmbeddingEngine(EmbeddingConfig(model=str(path), implementation="hearth", dtype="float32",
                                         show_progress=False, **options)) as engine:
        assert engine.implementation == "hearth"
        return engine.embed(texts, **kwargs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    cosine = F.cosine_similarity(actual, expected, dim=1)
    assert cosine.min().item() >= MIN_COSINE, cosine
    assert torch.allclose(actual.norm(dim=1), expected.norm(dim=1), rtol=1e-4)
    assert torch.allclose(actual, expected, atol=2e-5), (actual - expected).abs().max()


@pytest.mark.parametrize("kind, pooling", [("xlm-roberta", "cls"), ("xlm-roberta", "mean"),
                                           ("nomic_bert", "mean"), ("nomic_bert", "lasttoken"),
                                           ("modernbert", "mean"), ("modernbert", "cls"),
                                           ("modernbert", "lasttoken")])
def test_encoder_matches_sentence_transformers(tmp_path, kind, pooling):
    path = write_model(tmp_path, kind, pooling)
    assert read_encoder_spec(str(path)).pooling == pooling
    assert_close(ours(path, TEXTS), reference(path, TEXTS))


def test_unnormalized_model_keeps_its_norms(tmp_path):
    path = write_model(tmp_path, "modernbert", "mean", normalize=False)
    actual = ours(path, TEXTS)
    assert not torch.allclose(actual.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-3)
    assert_close(actual, reference(path, TEXTS))


def test_the_local_window_changes_modernbert_embeddings(tmp_path):
    """The check above could pass with every layer global if the window never bit; it does."""
    path = write_model(tmp_path, "modernbert", "mean")
    config = json.loads((path / "config.json").read_text())
    config["local_attention"] = 1024
    (path / "config.json").write_text(json.dumps(config))
    wide = ours(path, TEXTS[4:5])
    config["local_attention"] = 8
    (path / "config.json").write_text(json.dumps(config))
    narrow = ours(path, TEXTS[4:5])
    assert (wide - narrow).abs().max().item() > 20 * 2e-5       # well outside assert_close's tolerance
    assert_close(narrow, reference(path, TEXTS[4:5]))


def test_prompts_from_the_model_config_go_before_the_text(tmp_path):
    """multilingual-e5 style: "query: " / "passage: " prompts in config_sentence_transformers.json."""
    prompts = {"query": "query: ", "passage": "passage: "}
    path = write_model(tmp_path, "xlm-roberta", "mean", prompts=prompts)
    spec = read_encoder_spec(str(path))
    assert prompts.items() <= spec.prompts.items() and spec.query_prompt_name == "query"
    model = st.SentenceTransformer(str(path), device="cpu")
    expected_queries = model.encode_query(TEXTS, convert_to_tensor=True)
    assert_close(ours(path, TEXTS, prompt_name="query"), expected_queries)
    assert_close(ours(path, TEXTS, prompt_name="passage"), model.encode(TEXTS, prompt_name="passage",
                                                                        convert_to_tensor=True))
    # encode_document takes the first of document/passage/corpus the model has, as spec says
    assert_close(ours(path, TEXTS, prompt_name=spec.document_prompt_name),
                 model.encode_document(TEXTS, convert_to_tensor=True))
    assert_close(ours(path, TEXTS, prompt="query: "), expected_queries)
    assert F.cosine_similarity(ours(path, TEXTS[:1]), expected_queries[:1]).item() < 0.9999   # no prompt: differs


def test_a_default_prompt_name_applies_to_every_text(tmp_path):
    path = write_model(tmp_path, "nomic_bert", "mean", prompts={"query": "search_query: ",
                                                                "document": "search_document: "},
                       default_prompt_name="document")
    assert_close(ours(path, TEXTS), reference(path, TEXTS))
    assert_close(ours(path, TEXTS, prompt_name="query"), reference(path, TEXTS, prompt_name="query"))


def test_an_unknown_prompt_name_is_refused_naming_it(tmp_path):
    path = write_model(tmp_path, "xlm-roberta", "mean", prompts={"query": "query: "})
    with EmbeddingEngine(EmbeddingConfig(model=str(path))) as engine:
        with pytest.raises(ValueError, match="prompt_name 'passage' is not one of"):
            engine.embed(["x"], prompt_name="passage")


def test_matryoshka_dimensions_truncate_then_renormalize(tmp_path):
    path = write_model(tmp_path, "nomic_bert", "mean")
    actual = ours(path, TEXTS, dimensions=16)
    assert actual.shape == (len(TEXTS), 16)
    assert torch.allclose(actual.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    assert_close(actual, reference(path, TEXTS, truncate_dim=16, normalize_embeddings=True))
    full = ours(path, TEXTS)
    assert_close(actual, F.normalize(full[:, :16], dim=1))


def test_nomic_checkpoints_in_nomics_own_layout_embed_alike(tmp_path):
    """nomic-embed-text's hub files: nomic's config fields (n_embd, rotary_emb_base...) and its
    weight names (encoder.layers.N.attn.Wqkv, mlp.fc11/fc12/fc2, norm1/norm2, emb_ln)."""
    path = write_model(tmp_path, "nomic_bert", "mean")
    expected = ours(path, TEXTS)
    weights = load_file(str(path / "model.safetensors"))
    if "layers.0.self_attn.q_proj.weight" in weights:      # written in transformers' names: rename
        renamed = {"embeddings.word_embeddings.weight": weights["embeddings.word_embeddings.weight"],
                   "embeddings.token_type_embeddings.weight": weights["embeddings.token_type_embeddings.weight"],
                   "emb_ln.weight": weights["embeddings.LayerNorm.weight"],
                   "emb_ln.bias": weights["embeddings.LayerNorm.bias"]}
        for i in range(3):
            hf, nomic = f"layers.{i}.", f"encoder.layers.{i}."
            renamed[nomic + "attn.Wqkv.weight"] = torch.cat([weights[hf + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            renamed[nomic + "attn.out_proj.weight"] = weights[hf + "self_attn.o_proj.weight"]
            renamed[nomic + "mlp.fc11.weight"] = weights[hf + "mlp.up_proj.weight"]
            renamed[nomic + "mlp.fc12.weight"] = weights[hf + "mlp.gate_proj.weight"]
            renamed[nomic + "mlp.fc2.weight"] = weights[hf + "mlp.down_proj.weight"]
            for p in ("weight", "bias"):
                renamed[nomic + f"norm1.{p}"] = weights[hf + f"post_attention_layernorm.{p}"]
                renamed[nomic + f"norm2.{p}"] = weights[hf + f"post_mlp_layernorm.{p}"]
        save_file(renamed, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "nomic_bert", "architectures": ["NomicBertModel"], "vocab_size": 30522, "n_embd": 32,
        "n_layer": 3, "n_head": 4, "n_inner": 48, "n_positions": 128, "rotary_emb_base": 1000,
        "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_scaling_factor": None,
        "activation_function": "swiglu", "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
        "prenorm": False, "causal": False, "layer_norm_epsilon": 1e-12, "type_vocab_size": 2,
        "max_trained_positions": 2048}))
    assert_close(ours(path, TEXTS), expected)


# ---- config honesty and bad input --------------------------------------------------------------

@pytest.mark.parametrize("kind, field, value", [("nomic_bert", "prenorm", True), ("nomic_bert", "qkv_proj_bias", True),
                                                ("nomic_bert", "rotary_emb_fraction", 0.5),
                                                ("nomic_bert", "rotary_emb_interleaved", True),
                                                ("nomic_bert", "rotary_scaling_factor", 2.0),
                                                ("modernbert", "hidden_activation", "mish"),
                                                ("modernbert", "rope_scaling", {"rope_type": "linear", "factor": 2.0})])
def test_fields_that_change_the_math_and_are_not_implemented_are_refused_by_name(tmp_path, kind, field, value):
    path = write_model(tmp_path, kind)
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        EmbeddingEngine(EmbeddingConfig(model=str(path), implementation="hearth"))
    if kind == "nomic_bert":       # transformers' NomicBert ignores nomic's fields: no fallback either
        with pytest.raises(ValueError, match=f"{field}.*is no fallback"):
            EmbeddingEngine(EmbeddingConfig(model=str(path)))


def test_an_unknown_architecture_is_refused_naming_it(tmp_path):
    path = write_model(tmp_path, "xlm-roberta")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "no-such-bert"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'no-such-bert' is not a known architecture"):
        EmbeddingEngine(EmbeddingConfig(model=str(path)))


def test_a_model_naming_no_pooling_needs_pooling_given(tmp_path):
    path = write_model(tmp_path, "modernbert", "cls")
    modules = [m for m in json.loads((path / "modules.json").read_text()) if not m["type"].endswith("Pooling")]
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="names no pooling.*pass pooling="):
        EmbeddingEngine(EmbeddingConfig(model=str(path)))
    (path / "modules.json").unlink()            # a plain HF directory of a non-BERT type: the same
    with pytest.raises(ValueError, match="names no pooling"):
        EmbeddingEngine(EmbeddingConfig(model=str(path)))
    with EmbeddingEngine(EmbeddingConfig(model=str(path), pooling="cls", dtype="float32")) as engine:
        assert engine.spec.pooling == "cls"
        assert engine.embed(["x"]).shape == (1, 32)


def test_dimensions_above_the_model_size_are_refused_naming_it(tmp_path):
    path = write_model(tmp_path, "nomic_bert")
    with pytest.raises(ValueError, match="dimensions must be at most the model's hidden size 32, got 33"):
        EmbeddingEngine(EmbeddingConfig(model=str(path), dimensions=33))


@pytest.mark.parametrize("options, message", [({"dimensions": 0}, "dimensions must be a positive int"),
                                              ({"pooling": "weighted"}, "pooling must be one of")])
def test_bad_pooling_and_dimensions_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        EmbeddingConfig(**options)


def test_integrations_put_the_query_and_document_prompts_before_the_texts(tmp_path):
    from hearth_llm.integrations.langchain import HearthEmbeddings
    from hearth_llm.integrations.llama_index import HearthEmbedding

    path = write_model(tmp_path, "xlm-roberta", "mean", prompts={"query": "query: ", "passage": "passage: "})
    model = st.SentenceTransformer(str(path), device="cpu")
    queries = model.encode_query(TEXTS[:2], convert_to_tensor=True)
    documents = model.encode_document(TEXTS[:2], convert_to_tensor=True)
    options = {"dtype": "float32"}
    langchain = HearthEmbeddings(model=str(path), engine_kwargs=options)
    assert_close(torch.tensor([langchain.embed_query(text) for text in TEXTS[:2]]), queries)
    assert_close(torch.tensor(langchain.embed_documents(TEXTS[:2])), documents)
    llama_index = HearthEmbedding(model_name=str(path), engine_kwargs=options)
    assert_close(torch.tensor([llama_index.get_query_embedding(text) for text in TEXTS[:2]]), queries)
    assert_close(torch.tensor(llama_index.get_text_embedding_batch(TEXTS[:2])), documents)


def test_modernbert_hub_config_fields_embed_as_transformers_5_fields(tmp_path):
    """The hub's config.json (answerdotai/ModernBERT-base and its embedders) says
    global_attn_every_n_layers / global_rope_theta / local_rope_theta, not layer_types / rope_parameters."""
    path = write_model(tmp_path, "modernbert", "mean")
    expected = ours(path, TEXTS)
    config = json.loads((path / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    for name in ("layer_types", "rope_parameters"):
        config.pop(name)
    config.update(global_attn_every_n_layers=2, global_rope_theta=160000.0, local_rope_theta=10000.0)
    (path / "config.json").write_text(json.dumps(config))
    assert_close(ours(path, TEXTS), expected)
    config["local_rope_theta"] = 500.0          # the local base is read, not assumed
    (path / "config.json").write_text(json.dumps(config))
    assert (ours(path, TEXTS) - expected).abs().max() > 5 * 2e-5     # outside assert_close's tolerance
