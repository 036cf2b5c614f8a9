"""HearthEmbeddings: LangChain's standard embeddings suites (langchain-tests), plus what they leave out."""
from __future__ import annotations

import asyncio

import pytest
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_tests.integration_tests import EmbeddingsIntegrationTests
from langchain_tests.unit_tests import EmbeddingsUnitTests

from hearth_llm.embeddings import TextTooLongError, get_embedding_engine
from hearth_llm.integrations.langchain import HearthEmbeddings


class TestHearthEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[HearthEmbeddings]:
        return HearthEmbeddings


class TestHearthEmbeddingsIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[HearthEmbeddings]:
        return HearthEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"model": "default"}


def test_documents_and_queries_embed_alike():
    embeddings = HearthEmbeddings()
    assert embeddings.embed_documents(["Paris is in France."])[0] == pytest.approx(
        embeddings.embed_query("Paris is in France."), abs=1e-6)


async def test_native_async_calls_share_the_engine_batches():
    embeddings = HearthEmbeddings()
    engine = embeddings.engine
    await embeddings.aembed_query("warm up")
    before = engine.stats()["num_batches"]
    vectors = await asyncio.gather(*(embeddings.aembed_query(f"query {i}") for i in range(32)))
    assert engine.stats()["num_batches"] - before <= 2
    assert len(vectors) == 32 and all(len(vector) == 384 for vector in vectors)


def test_every_instance_on_a_model_shares_one_engine():
    assert HearthEmbeddings().engine is HearthEmbeddings(model="default").engine is get_embedding_engine()


def test_engine_kwargs_reach_the_engine():
    embeddings = HearthEmbeddings(engine_kwargs={"max_seq_length": 16}, truncate=False)
    assert embeddings.engine.max_seq_length == 16
    with pytest.raises(TextTooLongError, match="max_seq_length=16"):
        embeddings.embed_query("a sentence that certainly has more than sixteen tokens in it, many more than that")


def test_bad_input_is_refused_naming_the_argument():
    embeddings = HearthEmbeddings()
    with pytest.raises(ValueError, match="texts must be a non-empty list"):
        embeddings.embed_documents([])
    with pytest.raises(TypeError, match="text must be a str"):
        embeddings.embed_query(None)


def test_unknown_options_are_refused_at_construction():
    with pytest.raises(TypeError, match="unknown embedding engine option"):
        HearthEmbeddings(engine_kwargs={"batch_size": 8})


def test_a_vector_store_finds_the_matching_text():
    store = InMemoryVectorStore.from_texts(
        ["Paris is the capital of France.", "The Nile flows through Egypt.", "Python is a programming language."],
        HearthEmbeddings())
    assert store.similarity_search("Which river runs through Egypt?", k=1)[0].page_content == \
        "The Nile flows through Egypt."
