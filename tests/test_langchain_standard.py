"""LangChain's standard chat model suites (langchain-tests), run offline on the default model.

Tool calling and structured output are not offered yet, so the suites skip those tests on their own.
"""
from __future__ import annotations

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from hearth_llm.engine.loader import default_model_path
from hearth_llm.integrations.langchain import ChatHearth

# Short answers keep the suite fast on two CPU cores; greedy keeps it repeatable.
PARAMS = {"model": "default", "temperature": 0, "max_tokens": 24}


class TestChatHearthUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatHearth]:
        return ChatHearth

    @property
    def chat_model_params(self) -> dict:
        return {"model": "default"}  # the suite adds max_tokens and stop itself


class TestChatHearthIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatHearth]:
        return ChatHearth

    @property
    def chat_model_params(self) -> dict:
        return PARAMS

    @property
    def model_override_value(self) -> str:
        # The bundled file by its path: another name for the same checkpoint, so the same engine.
        return str(default_model_path())

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        chat = ChatHearth(**{**PARAMS, "max_tokens": 4})
        messages = [SystemMessage("You are a patient tutor who explains ideas with short examples. " * 3),
                    HumanMessage("What is a noun?")]
        chat.invoke(messages)  # the second call reads the system prompt's blocks from the prefix cache
        if not stream:
            return chat.invoke(messages)
        full = None
        for chunk in chat.stream(messages):
            full = chunk if full is None else full + chunk
        return full
