"""HearthReranker as a LangChain document compressor and a LlamaIndex node postprocessor: the
engine's cross-encoder scores, ordered and cut to top_n, sync and async alike."""
from __future__ import annotations

import pytest
from langchain_core.documents import Document
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from test_rerank import DOCUMENTS, QUERY, write_reranker

from hearth_llm.embeddings import get_embedding_engine
from hearth_llm.integrations.langchain import HearthReranker as LangChainReranker
from hearth_llm.integrations.llama_index import HearthReranker as LlamaIndexReranker

OPTIONS = {"dtype": "float32", "max_seq_length": 64}


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory):
    return str(write_reranker(tmp_path_factory.mktemp("reranker"), "bert"))


@pytest.fixture(scope="module")
def expected(reranker_path):
    scores = get_embedding_engine(reranker_path, **OPTIONS).score(QUERY, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    return scores, order


def test_langchain_compressor_keeps_the_top_n_best_first(reranker_path, expected):
    scores, order = expected
    reranker = LangChainReranker(model=reranker_path, top_n=3, engine_kwargs=OPTIONS)
    documents = [Document(page_content=text, metadata={"index": i}) for i, text in enumerate(DOCUMENTS)]
    kept = reranker.compress_documents(documents, QUERY)
    assert [doc.metadata["index"] for doc in kept] == order[:3]
    assert [doc.metadata["relevance_score"] for doc in kept] == [scores[i] for i in order[:3]]
    assert "relevance_score" not in documents[0].metadata        # the caller's documents are not changed


async def test_langchain_async_equals_sync(reranker_path):
    reranker = LangChainReranker(model=reranker_path, top_n=None, engine_kwargs=OPTIONS)
    documents = [Document(page_content=text) for text in DOCUMENTS]
    sync = reranker.compress_documents(documents, QUERY)
    assert len(sync) == len(DOCUMENTS)
    assert await reranker.acompress_documents(documents, QUERY) == sync
    assert reranker.compress_documents([], QUERY) == []


def test_langchain_reranker_refuses_an_embedding_model_and_bad_options(reranker_path):
    with pytest.raises(ValueError, match="not a cross-encoder"):
        LangChainReranker(model="default")
    with pytest.raises(TypeError, match="unknown embedding engine option"):
        LangChainReranker(model=reranker_path, engine_kwargs={"no_such_option": 1})
    with pytest.raises(ValueError, match="top_n"):
        LangChainReranker(model=reranker_path, top_n=0)


def test_llama_index_postprocessor_scores_and_orders_nodes(reranker_path, expected):
    scores, order = expected
    reranker = LlamaIndexReranker(model=reranker_path, top_n=2, keep_retrieval_score=True, engine_kwargs=OPTIONS)
    nodes = [NodeWithScore(node=TextNode(text=text, id_=str(i)), score=0.5) for i, text in enumerate(DOCUMENTS)]
    kept = reranker.postprocess_nodes(nodes, query_str=QUERY)
    assert [node.node.id_ for node in kept] == [str(i) for i in order[:2]]
    assert [node.score for node in kept] == [scores[i] for i in order[:2]]
    assert kept[0].node.metadata["retrieval_score"] == 0.5


async def test_llama_index_async_equals_sync(reranker_path):
    reranker = LlamaIndexReranker(model=reranker_path, top_n=4, engine_kwargs=OPTIONS)
    nodes = [NodeWithScore(node=TextNode(text=text, id_=str(i))) for i, text in enumerate(DOCUMENTS)]
    sync = reranker.postprocess_nodes(nodes, query_bundle=QueryBundle(QUERY))
    asynchronous = await reranker.apostprocess_nodes(nodes, query_str=QUERY)
    assert [(n.node.id_, n.score) for n in asynchronous] == [(n.node.id_, n.score) for n in sync]


def test_llama_index_reranker_needs_a_query(reranker_path):
    reranker = LlamaIndexReranker(model=reranker_path, engine_kwargs=OPTIONS)
    with pytest.raises(ValueError, match="query_bundle"):
        reranker.postprocess_nodes([NodeWithScore(node=TextNode(text="x"))])
