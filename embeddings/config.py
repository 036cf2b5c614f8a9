"""Embedding engine settings: every field can be passed to ``get_embedding_engine(...)``,
``HearthEmbeddings(...)`` and ``HearthEmbedding(...)`` as a keyword."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from .model_dir import POOLING_MODES

_DTYPES = {"auto": torch.float32, "float32": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
IMPLEMENTATIONS = ("auto", "hearth", "transformers")
TASKS = ("auto", "embed", "score")


@dataclass(slots=True)
class EmbeddingConfig:
    """How the embedding engine loads its model and forms batches.

    >>> EmbeddingConfig(model="default", max_batch_tokens=4096)

    - ``model``: ``"default"`` (all-MiniLM-L6-v2, bundled) or a sentence-transformers directory
      (a plain BERT-family HF directory works too: mean pooling, no normalization). Our encoders:
      BERT, RoBERTa, XLM-RoBERTa (bge-m3, multilingual-e5), NomicBert, ModernBERT; decoders the
      LLM engine runs (Qwen3-Embedding; see ``task``); a directory whose config.json names a
      ``*ForSequenceClassification`` head with one label is a cross-encoder reranker
      (``EmbeddingEngine.score``).
    - ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (CUDA when available).
    - ``dtype``: ``"auto"`` (default): float32, and on CPUs with bf16 matmuls (AVX-512 BF16, AMX)
      our encoder's mixed precision — the attention output projections and the last feed-forward
      block in bf16, ~9 % faster on all-MiniLM-L6-v2 — kept only when a check at load finds it
      within cosine 0.999995 of float32 on that model. ``"float32"``: all float32 (the exact
      path); ``"bfloat16"`` (1.7× faster on CPUs with AVX-512 BF16, cosine ≥ 0.9998) or ``"float16"``.
    - ``max_seq_length``: tokens per text, special tokens included; default the model directory's
      ``max_seq_length``. Longer texts are truncated, or refused when a request says ``truncate=False``.
    - ``max_batch_tokens``: padded tokens (texts × longest text) in one forward pass; default 2048
      on CPU (throughput is flat from 512 to 4096 and drops at 8192, where activations outgrow
      the caches) and 16384 on CUDA.
    - ``max_batch_size``: texts in one forward pass; default 64 on CPU, 512 on CUDA. A step of
      the engine takes four batches' worth of texts per worker (on CUDA one batch's worth), so a
      query that arrives behind a large corpus waits for about one step (~1 s on two CPU cores).
    - ``num_workers``: forward passes that run at once, each on one CPU thread; default
      ``torch.get_num_threads()`` on CPU (one per core), 1 on CUDA. With 1, every batch runs on
      the engine thread with all of torch's intra-op threads. With more, the engine thread runs on
      one thread too (a step with a single batch — a lone query — runs there, without a hand-off:
      4.8 ms for an 11-token query where two threads take 3.6), so that the embedding engine never
      holds a multi-threaded OpenMP team that would slow the process's other torch work.
    - ``implementation``: ``"auto"`` (ours for the encoders above with safetensors weights and a
      config they run exactly, else transformers),
      ``"hearth"`` or ``"transformers"`` (``AutoModel`` with SDPA attention).
    - ``show_progress``: default of the per-request progress bar (``None``: only for large requests).
    - ``pooling``: overrides the model directory's pooling mode (``"mean"``, ``"cls"``, ``"max"``,
      ``"mean_sqrt_len"``, ``"lasttoken"``); required for a model that names none.
    - ``dimensions``: Matryoshka truncation — keep the first ``dimensions`` components of each
      vector (re-normalized when the model normalizes); at most the model's hidden size.
    - ``task``: ``"auto"`` (default: a ``*ForSequenceClassification`` directory scores, anything
      else embeds), ``"embed"`` or ``"score"``. A decoder LLM directory (``*ForCausalLM`` the LLM
      engine runs, e.g. Qwen3) embeds with the pooling its sentence-transformers files name
      (Qwen3-Embedding: last token); with ``task="score"`` it is an LLM reranker (Qwen3-Reranker:
      the probability of "yes" against "no" after its judging prompt). Decoders run on the LLM
      engine's own model code, with no KV cache kept.
    - ``compile``: on CUDA in float16/bfloat16, run the second half of each layer of our
      BERT-family encoders (output projection, feed-forward, residuals, layer norms) through
      ``torch.compile`` (embeddings/compiled_block.py: fewer passes over the activations). It
      compiles at load, which takes tens of seconds on a machine whose compile caches are cold, so
      it is off by default. The CPU and float32 always run eagerly.
    """

    model: str = "default"
    device: str = "cpu"
    dtype: str = "auto"
    max_seq_length: int | None = None
    max_batch_tokens: int | None = None
    max_batch_size: int | None = None
    implementation: str = "auto"
    num_workers: int | None = None
    show_progress: bool | None = None
    pooling: str | None = None
    dimensions: int | None = None
    task: str = "auto"
    compile: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ValueError(f"model must be a non-empty str or path, got {self.model!r}")
        self.model = str(self.model)
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}")
        for name in ("max_batch_tokens", "max_batch_size", "num_workers", "dimensions"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.max_seq_length is not None:
            _check_positive_int("max_seq_length", self.max_seq_length)
            if self.max_seq_length < 2:
                raise ValueError(f"max_seq_length must be at least 2 (room for the special tokens), "
                                 f"got {self.max_seq_length}")
        if self.pooling is not None and self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES} or None, got {self.pooling!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        if self.show_progress is not None and not isinstance(self.show_progress, bool):
            raise ValueError(f"show_progress must be True, False or None, got {self.show_progress!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def batch_token_budget(self) -> int:
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return 16384 if self.torch_device.type == "cuda" else 2048

    @property
    def batch_size_limit(self) -> int:
        if self.max_batch_size is not None:
            return self.max_batch_size
        return 512 if self.torch_device.type == "cuda" else 64

    @property
    def worker_count(self) -> int:
        if self.num_workers is not None:
            return self.num_workers
        return 1 if self.torch_device.type == "cuda" else torch.get_num_threads()

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def allows_mixed_precision(self) -> bool:
        return self.dtype == "auto" and self.torch_device.type == "cpu"

    @classmethod
    def from_kwargs(cls, model: str = "default", **kwargs) -> EmbeddingConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown embedding engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
