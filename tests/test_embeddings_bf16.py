"""bfloat16 for the encoders beside BERT (XLM-RoBERTa, NomicBert, ModernBERT), the decoder
embedder and the LLM reranker: close to our float32 path (cosine >= 0.999 per text; scores within
0.02), and really in bfloat16 (the vectors differ from float32's). On this CPU where it has bf16
matmuls (AVX-512 BF16 / AMX); tests/test_gpu_embeddings.py runs the same checks on CUDA.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from embedding_dirs import write_encoder
from test_embeddings_decoder import DOCUMENTS, QUERY, TEXTS, embedding_dir, reranker_dir  # noqa: F401 - fixtures

from hearth_llm.embeddings import EmbeddingConfig, EmbeddingEngine

MIN_COSINE = 0.999
MAX_SCORE_DIFFERENCE = 0.02


def embed(path, device: str, dtype: str) -> tuple[torch.Tensor, str]:
    with EmbeddingEngine(EmbeddingConfig(model=str(path), device=device, dtype=dtype, show_progress=False,
                                         max_batch_size=4)) as engine:
        return engine.embed(TEXTS), engine.precision


def check_close_in_low_precision(path, device: str, dtype: str = "bfloat16", min_cosine: float = MIN_COSINE) -> None:
    exact, _ = embed(path, "cpu", "float32")
    low, precision = embed(path, device, dtype)
    assert precision == dtype
    assert low.dtype == torch.float32 and low.shape == exact.shape    # handed out as float32 whatever ran
    cosine = F.cosine_similarity(low, exact, dim=1)
    assert cosine.min().item() >= min_cosine, cosine
    assert (low - exact).abs().max().item() > 1e-6                    # it did run in low precision


def check_scores_in_low_precision(path, device: str, dtype: str = "bfloat16") -> None:
    def scores(device: str, dtype: str) -> torch.Tensor:
        with EmbeddingEngine(EmbeddingConfig(model=str(path), task="score", device=device, dtype=dtype,
                                             max_seq_length=512, show_progress=False)) as engine:
            return torch.tensor(engine.score(QUERY, DOCUMENTS))

    exact, low = scores("cpu", "float32"), scores(device, dtype)
    assert (low - exact).abs().max().item() <= MAX_SCORE_DIFFERENCE, (low, exact)


needs_bf16_cpu = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


@needs_bf16_cpu
@pytest.mark.parametrize("kind", ["xlm-roberta", "nomic_bert", "modernbert"])
def test_new_encoders_in_bfloat16_stay_close_to_float32(tmp_path, kind):
    check_close_in_low_precision(write_encoder(tmp_path, kind, "mean"), "cpu")


@needs_bf16_cpu
def test_decoder_embedder_in_bfloat16_stays_close_to_float32(embedding_dir):  # noqa: F811
    check_close_in_low_precision(embedding_dir, "cpu")


@needs_bf16_cpu
def test_llm_reranker_in_bfloat16_scores_close_to_float32(reranker_dir):  # noqa: F811
    check_scores_in_low_precision(reranker_dir, "cpu")
