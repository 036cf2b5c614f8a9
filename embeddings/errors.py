"""What the embedding engine raises, each cause its own type."""
from __future__ import annotations


class EmbeddingError(RuntimeError):
    """Base class of the engine-side errors below (bad input raises ``TypeError``/``ValueError``)."""


class EmbeddingEngineDeadError(EmbeddingError):
    """The engine thread stopped (loading the model failed, or it crashed); ``__cause__`` says why."""


class EmbeddingEngineClosedError(EmbeddingEngineDeadError):
    """The engine was closed (``close()``, a ``with`` block's exit, or interpreter exit)."""


class EmbeddingFailedError(EmbeddingError):
    """The forward pass of a batch holding this request's texts raised; the engine keeps serving."""


class TextTooLongError(ValueError):
    """A text has more tokens than ``max_seq_length`` and the request said ``truncate=False``."""
