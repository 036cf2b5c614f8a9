"""LlamaIndex classes served by the in-process hearth engines.

>>> from hearth_llm.integrations.llama_index import HearthEmbedding, HearthLLM
>>> HearthEmbedding().get_text_embedding("Paris is the capital of France.")[:3]
"""
from .embeddings import HearthEmbedding
from .llm import HearthLLM
from .rerank import HearthReranker

__all__ = ["HearthEmbedding", "HearthLLM", "HearthReranker"]
