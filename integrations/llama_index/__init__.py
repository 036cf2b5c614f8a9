"""LlamaIndex classes served by the in-process hearth engines.

>>> from hearth_llm.integrations.llama_index import HearthEmbedding
>>> HearthEmbedding().get_text_embedding("Paris is the capital of France.")[:3]
"""
from .embeddings import HearthEmbedding

__all__ = ["HearthEmbedding"]
from .llm import HearthLLM  # noqa: E402,F401
