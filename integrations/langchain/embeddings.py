"""``HearthEmbeddings``: LangChain embeddings served by the in-process hearth embedding engine."""
from __future__ import annotations

from typing import Any

from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from hearth_llm.embeddings import EmbeddingEngine, get_embedding_engine


class HearthEmbeddings(BaseModel, Embeddings):
    """Embed texts with a local sentence-transformers model, in this process: no server, no API key.

    Setup:
        .. code-block:: bash

            pip install "hearth-llm[langchain]"

    Key init args:
        model: ``"default"`` (all-MiniLM-L6-v2, bundled, 384 dimensions, unit length) or a
            sentence-transformers directory (BERT, XLM-RoBERTa, NomicBert, ModernBERT, or a decoder
            embedder such as Qwen3-Embedding, run on the LLM engine's model code). Queries get the
            model's ``"query"`` prompt and documents its document prompt, when it has them.
        truncate: cut texts longer than the model's ``max_seq_length`` (default); with ``False``
            such a text raises ``TextTooLongError``.
        show_progress: progress bar for ``embed_documents``; ``None`` shows one for 1000+ texts.
        engine_kwargs: :class:`~hearth_llm.embeddings.EmbeddingConfig` fields (``max_seq_length``,
            ``max_batch_tokens``, ``device``, ``dtype``...). Every HearthEmbeddings and
            ``HearthEmbedding`` (LlamaIndex) on the same model and config shares one engine, whose
            thread batches all their texts together.

    Instantiate (cheap: the model loads on the first call):
        .. code-block:: python

            from hearth_llm.integrations.langchain import HearthEmbeddings

            embeddings = HearthEmbeddings()

    Embed:
        .. code-block:: python

            vectors = embeddings.embed_documents(["The cat sat on the mat.", "Paris is in France."])
            len(vectors), len(vectors[0])          # (2, 384)
            query = embeddings.embed_query("Where is Paris?")

    Async (native: the event loop only waits; concurrent calls share forward passes):
        .. code-block:: python

            vectors = await embeddings.aembed_documents(texts)
            queries = await asyncio.gather(*(embeddings.aembed_query(q) for q in questions))

    In a vector store:
        .. code-block:: python

            from langchain_core.vectorstores import InMemoryVectorStore

            store = InMemoryVectorStore.from_texts(["Paris is in France.", "Rome is in Italy."], embeddings)
            store.similarity_search("Where is Paris?", k=1)
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = "default"
    """``"default"`` (all-MiniLM-L6-v2) or a sentence-transformers model directory."""
    truncate: bool = True
    """Cut texts longer than ``max_seq_length`` tokens; ``False`` raises for them instead."""
    show_progress: bool | None = None
    """Progress bar for ``embed_documents``: ``None`` shows one for 1000+ texts."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """:class:`~hearth_llm.embeddings.EmbeddingConfig` fields for the shared engine."""

    _engine: EmbeddingEngine | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any, /) -> None:
        self._engine = get_embedding_engine(self.model, **self.engine_kwargs)   # bad options raise here

    @property
    def engine(self) -> EmbeddingEngine:
        """The shared engine (a fresh one if the last was closed)."""
        if self._engine is None or self._engine.is_stopped:
            self._engine = get_embedding_engine(self.model, **self.engine_kwargs)
        return self._engine

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """One vector (a list of Python floats) per text; with the model's document prompt, if it has one."""
        return self.engine.embed(texts, truncate=self.truncate, show_progress=self.show_progress,
                                 prompt_name=self.engine.spec.document_prompt_name).tolist()

    def embed_query(self, text: str) -> list[float]:
        """With the model's ``"query"`` prompt, if it has one (as sentence-transformers' ``encode_query``)."""
        return self.engine.embed_one(text, truncate=self.truncate,
                                     prompt_name=self.engine.spec.query_prompt_name).tolist()

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        vectors = await self.engine.aembed(texts, truncate=self.truncate, show_progress=self.show_progress,
                                           prompt_name=self.engine.spec.document_prompt_name)
        return vectors.tolist()

    async def aembed_query(self, text: str) -> list[float]:
        return (await self.engine.aembed_one(text, truncate=self.truncate,
                                             prompt_name=self.engine.spec.query_prompt_name)).tolist()
