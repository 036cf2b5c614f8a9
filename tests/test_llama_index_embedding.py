"""HearthEmbedding in LlamaIndex: an index built and queried offline, sync and async."""
from __future__ import annotations

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.llms import MockLLM

from hearth_llm.integrations.llama_index import HearthEmbedding

CORPUS = ["Paris is the capital and largest city of France.",
          "The Nile is the longest river in Africa and flows through Egypt.",
          "Python is a programming language that emphasizes readability.",
          "Mount Everest is the highest mountain above sea level.",
          "The mitochondria is the powerhouse of the cell."]


@pytest.fixture(scope="module")
def embed_model() -> HearthEmbedding:
    return HearthEmbedding()


@pytest.fixture(scope="module")
def index(embed_model) -> VectorStoreIndex:
    return VectorStoreIndex.from_documents([Document(text=text) for text in CORPUS], embed_model=embed_model)


def test_the_retriever_finds_the_matching_document(index):
    nodes = index.as_retriever(similarity_top_k=1).retrieve("Which river flows through Egypt?")
    assert nodes[0].node.get_content() == CORPUS[1]


def test_a_query_engine_runs_with_a_mock_llm(index):
    response = index.as_query_engine(llm=MockLLM(), similarity_top_k=2).query("What is the capital of France?")
    assert CORPUS[0] in {node.node.get_content() for node in response.source_nodes}


def test_an_index_builds_through_the_async_path(embed_model):
    index = VectorStoreIndex.from_documents([Document(text=text) for text in CORPUS], embed_model=embed_model,
                                            use_async=True)
    nodes = index.as_retriever(similarity_top_k=1).retrieve("highest mountain")
    assert nodes[0].node.get_content() == CORPUS[3]


async def test_async_retrieval_embeds_the_query_natively(index):
    nodes = await index.as_retriever(similarity_top_k=1).aretrieve("What powers the cell?")
    assert nodes[0].node.get_content() == CORPUS[4]


async def test_async_batches_share_the_engine_and_match_sync(embed_model):
    texts = [f"sentence number {i}" for i in range(40)]
    expected = embed_model.get_text_embedding_batch(texts)
    small_calls = HearthEmbedding(embed_batch_size=4)     # ten concurrent calls into the shared engine
    engine = small_calls.engine
    assert engine is embed_model.engine
    before = engine.stats()["num_batches"]
    vectors = await small_calls.aget_text_embedding_batch(texts)
    assert engine.stats()["num_batches"] - before <= 3
    assert vectors == [pytest.approx(vector, abs=1e-5) for vector in expected]


def test_query_and_text_embeddings_are_python_floats(embed_model):
    query = embed_model.get_query_embedding("Where is Paris?")
    assert len(query) == 384 and all(isinstance(value, float) for value in query)
    assert embed_model.get_text_embedding("Where is Paris?") == pytest.approx(query, abs=1e-6)


def test_bad_input_is_refused_naming_the_argument(embed_model):
    with pytest.raises(TypeError, match="text must be a str"):
        embed_model.get_query_embedding(123)
