"""``HearthReranker``: a LlamaIndex node postprocessor that reranks with an in-process cross-encoder."""
from __future__ import annotations

from typing import Any

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from pydantic import Field, PrivateAttr

from hearth_llm.embeddings import EmbeddingEngine, get_embedding_engine


class HearthReranker(BaseNodePostprocessor):
    """Rerank retrieved nodes with a local cross-encoder, in this process (as LlamaIndex's
    ``SentenceTransformerRerank`` does, without loading a second copy per postprocessor).

    >>> from hearth_llm.integrations.llama_index import HearthReranker
    >>> reranker = HearthReranker(model="/models/bge-reranker-v2-m3", top_n=3)
    >>> query_engine = index.as_query_engine(similarity_top_k=10, node_postprocessors=[reranker])
    >>> reranker.postprocess_nodes(nodes, query_str="Where is Paris?")[0].score       # the cross-encoder's
    >>> await reranker.apostprocess_nodes(nodes, query_str="Where is Paris?")          # native async

    ``model`` may be an LLM reranker too (a causal LM directory such as Qwen3-Reranker, scored by
    P("yes") after its judging prompt; ``instruction`` sets its task line). ``engine_kwargs`` are
    :class:`~hearth_llm.embeddings.EmbeddingConfig` fields; rerankers on the same model and config
    share one engine. ``keep_retrieval_score`` keeps the retriever's score in ``metadata["retrieval_score"]``.
    """

    model: str = Field(description="A cross-encoder model directory.")
    top_n: int = Field(default=2, ge=1, description="Nodes kept, best first.")
    keep_retrieval_score: bool = Field(default=False, description="Keep the old score in metadata.")
    truncate: bool = Field(default=True, description="Cut pairs longer than max_seq_length; False raises.")
    instruction: str | None = Field(default=None, description="An LLM reranker's task line (None: its default).")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="EmbeddingConfig fields.")

    _engine: EmbeddingEngine | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        self._engine = self._shared_engine()   # bad options, or a model that cannot rerank, raise here

    def _shared_engine(self) -> EmbeddingEngine:
        # task="score": a causal LM directory becomes an LLM reranker; a cross-encoder scores either way
        return get_embedding_engine(self.model, **{"task": "score", **self.engine_kwargs})

    @classmethod
    def class_name(cls) -> str:
        return "HearthReranker"

    @property
    def engine(self) -> EmbeddingEngine:
        if self._engine is None or self._engine.is_stopped:
            self._engine = self._shared_engine()
        return self._engine

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        query, texts = self._inputs(nodes, query_bundle)
        if not texts:
            return []
        return self._ranked(nodes, self.engine.score(query, texts, truncate=self.truncate,
                                                       instruction=self.instruction))

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore],
                                  query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        query, texts = self._inputs(nodes, query_bundle)
        if not texts:
            return []
        return self._ranked(nodes, await self.engine.ascore(query, texts, truncate=self.truncate,
                                                             instruction=self.instruction))

    @staticmethod
    def _inputs(nodes: list[NodeWithScore], query_bundle: QueryBundle | None) -> tuple[str, list[str]]:
        if query_bundle is None:
            raise ValueError("query_bundle (or query_str) is required to rerank")
        return query_bundle.query_str, [node.node.get_content(metadata_mode=MetadataMode.EMBED) for node in nodes]

    def _ranked(self, nodes: list[NodeWithScore], scores: list[float]) -> list[NodeWithScore]:
        ranked = []
        for i in sorted(range(len(nodes)), key=lambda i: -scores[i])[:self.top_n]:
            node = nodes[i]
            if self.keep_retrieval_score:
                node.node.metadata["retrieval_score"] = node.score
            ranked.append(NodeWithScore(node=node.node, score=scores[i]))
        return ranked
