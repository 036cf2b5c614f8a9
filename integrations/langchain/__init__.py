"""LangChain classes served by the in-process hearth engine.

>>> from hearth_llm.integrations.langchain import ChatHearth
>>> ChatHearth(temperature=0, max_tokens=32).invoke("What is the capital of France?").content
"""
from .chat_models import ChatHearth

__all__ = ["ChatHearth"]
from .embeddings import HearthEmbeddings  # noqa: E402
__all__ += ["HearthEmbeddings"]
from .rerank import HearthReranker  # noqa: E402
__all__ += ["HearthReranker"]
