"""``HearthEmbedding``: a LlamaIndex embedding model served by the in-process hearth embedding engine."""
from __future__ import annotations

from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from pydantic import Field, PrivateAttr

from hearth_llm.embeddings import EmbeddingEngine, get_embedding_engine


class HearthEmbedding(BaseEmbedding):
    """Embed nodes and queries with a local sentence-transformers model, in this process.

    >>> from llama_index.core import Document, Settings, VectorStoreIndex
    >>> from hearth_llm.integrations.llama_index import HearthEmbedding
    >>> Settings.embed_model = HearthEmbedding()          # all-MiniLM-L6-v2, bundled; loads on first use
    >>> index = VectorStoreIndex.from_documents([Document(text="Paris is the capital of France.")])
    >>> index.as_retriever(similarity_top_k=1).retrieve("Which city is France's capital?")[0].score
    >>> await HearthEmbedding().aget_text_embedding_batch(texts)    # native async; calls share batches

    ``model_name`` is ``"default"`` or a sentence-transformers directory (an encoder, or a decoder
    embedder such as Qwen3-Embedding: last token, its query prompt); ``engine_kwargs`` are
    :class:`~hearth_llm.embeddings.EmbeddingConfig` fields. Every HearthEmbedding and LangChain
    ``HearthEmbeddings`` on the same model and config shares one engine. ``embed_batch_size`` is how
    many texts LlamaIndex hands over per call; the engine forms its own forward batches from them.
    """

    model_name: str = Field(default="default", description="'default' (all-MiniLM-L6-v2) or a model directory.")
    embed_batch_size: int = Field(default=512, gt=0, le=2048,
                                  description="Texts per call into the engine (which batches on its own).")
    truncate: bool = Field(default=True, description="Cut texts longer than max_seq_length; False raises.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="EmbeddingConfig fields.")

    _engine: EmbeddingEngine | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        self._engine = get_embedding_engine(self.model_name, **self.engine_kwargs)   # bad options raise here

    @classmethod
    def class_name(cls) -> str:
        return "HearthEmbedding"

    @property
    def engine(self) -> EmbeddingEngine:
        """The shared engine (a fresh one if the last was closed)."""
        if self._engine is None or self._engine.is_stopped:
            self._engine = get_embedding_engine(self.model_name, **self.engine_kwargs)
        return self._engine

    # Queries get the model's "query" prompt, texts its document prompt, when it has them.
    def _get_query_embedding(self, query: str) -> Embedding:
        return self.engine.embed_one(query, truncate=self.truncate, prompt_name=self._query_prompt).tolist()

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return (await self.engine.aembed_one(query, truncate=self.truncate, prompt_name=self._query_prompt)).tolist()

    def _get_text_embedding(self, text: str) -> Embedding:
        return self.engine.embed_one(text, truncate=self.truncate, prompt_name=self._document_prompt).tolist()

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return (await self.engine.aembed_one(text, truncate=self.truncate,
                                             prompt_name=self._document_prompt)).tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        # LlamaIndex draws its own progress bar (show_progress=...), so the engine draws none.
        return self.engine.embed(texts, truncate=self.truncate, show_progress=False,
                                 prompt_name=self._document_prompt).tolist()

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return (await self.engine.aembed(texts, truncate=self.truncate, show_progress=False,
                                         prompt_name=self._document_prompt)).tolist()

    @property
    def _query_prompt(self) -> str | None:
        return self.engine.spec.query_prompt_name

    @property
    def _document_prompt(self) -> str | None:
        return self.engine.spec.document_prompt_name
