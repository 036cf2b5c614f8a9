"""``HearthReranker``: a LangChain document compressor that reranks with an in-process cross-encoder
or LLM reranker."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from pydantic import ConfigDict, Field, PrivateAttr

from hearth_llm.embeddings import EmbeddingEngine, get_embedding_engine


class HearthReranker(BaseDocumentCompressor):
    """Rerank retrieved documents with a local cross-encoder (bge-reranker, ms-marco MiniLM...), in this process.

    Setup:
        .. code-block:: bash

            pip install "hearth-llm[langchain]"

    Key init args:
        model: a cross-encoder directory (``*ForSequenceClassification``, one label), as
            sentence-transformers' ``CrossEncoder`` loads it, or an LLM reranker (a causal LM
            directory such as Qwen3-Reranker: scored by P("yes") after its judging prompt).
        top_n: how many documents to keep, best first (``None``: all, reordered).
        instruction: an LLM reranker's task line (``None``: its default web-search one).
        engine_kwargs: :class:`~hearth_llm.embeddings.EmbeddingConfig` fields (``max_seq_length``,
            ``max_batch_tokens``, ``device``...). Every reranker on the same model shares one engine,
            whose thread batches all callers' pairs together.

    Use in a retriever:
        .. code-block:: python

            from langchain_classic.retrievers import ContextualCompressionRetriever
            from hearth_llm.integrations.langchain import HearthReranker

            reranker = HearthReranker(model="/models/bge-reranker-v2-m3", top_n=3)
            retriever = ContextualCompressionRetriever(base_compressor=reranker, base_retriever=base)
            retriever.invoke("Where is Paris?")

    Directly (sync or async; each kept document gets ``metadata["relevance_score"]``):
        .. code-block:: python

            docs = reranker.compress_documents(documents, "Where is Paris?")
            docs = await reranker.acompress_documents(documents, "Where is Paris?")
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str
    """A cross-encoder model directory."""
    top_n: int | None = Field(default=3, ge=1)
    """Documents kept, best first; ``None`` keeps all."""
    truncate: bool = True
    """Cut pairs longer than ``max_seq_length`` tokens; ``False`` raises for them instead."""
    instruction: str | None = None
    """An LLM reranker's task line; ``None``: its default. Not for cross-encoders."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """:class:`~hearth_llm.embeddings.EmbeddingConfig` fields for the shared engine."""

    _engine: EmbeddingEngine | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any, /) -> None:
        self._engine = self._shared_engine()   # bad options, or a model that cannot rerank, raise here

    def _shared_engine(self) -> EmbeddingEngine:
        # task="score": a causal LM directory reranks (an LLM reranker) instead of being refused
        # for naming no pooling; a cross-encoder scores either way.
        return get_embedding_engine(self.model, **{"task": "score", **self.engine_kwargs})

    @property
    def engine(self) -> EmbeddingEngine:
        """The shared engine (a fresh one if the last was closed)."""
        if self._engine is None or self._engine.is_stopped:
            self._engine = self._shared_engine()
        return self._engine

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Callbacks | None = None) -> Sequence[Document]:
        """The ``top_n`` documents most relevant to ``query``, best first."""
        if not documents:
            return []
        scores = self.engine.score(query, [doc.page_content for doc in documents], truncate=self.truncate,
                                   instruction=self.instruction)
        return self._ranked(documents, scores)

    async def acompress_documents(self, documents: Sequence[Document], query: str,
                                  callbacks: Callbacks | None = None) -> Sequence[Document]:
        """Native async: the event loop waits while the engine thread scores."""
        if not documents:
            return []
        scores = await self.engine.ascore(query, [doc.page_content for doc in documents], truncate=self.truncate,
                                          instruction=self.instruction)
        return self._ranked(documents, scores)

    def _ranked(self, documents: Sequence[Document], scores: list[float]) -> list[Document]:
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:self.top_n]
        return [Document(page_content=documents[i].page_content, id=documents[i].id,
                         metadata={**documents[i].metadata, "relevance_score": scores[i]}) for i in order]
