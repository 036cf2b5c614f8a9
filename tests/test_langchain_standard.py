"""LangChain's standard chat model suites (langchain-tests), run offline on the default model.

SmolLM2-135M rarely decides to call a tool, and its JSON strings run on; the suites still pass
because forced tool calls and structured output are decoded under a grammar. Multimodal inputs
are declared unsupported: the engine serves text-only models.
"""
from __future__ import annotations

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from hearth_llm.engine.loader import default_model_path
from hearth_llm.integrations.langchain import ChatHearth

# Greedy keeps the suite repeatable. Under greedy decoding SmolLM2-135M repeats itself, inside JSON
# strings too: mild frequency and repetition penalties let its strings end within 128 tokens (a
# stronger repetition penalty keeps it from copying arguments out of the question). It never calls
# a tool on its own, so calls that offer tools force one (tool_choice="any"), as the tool tests expect.
PARAMS = {"model": "default", "temperature": 0, "max_tokens": 128, "frequency_penalty": 0.5,
          "repetition_penalty": 1.05, "tool_choice": "any"}


class TestChatHearthUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatHearth]:
        return ChatHearth

    @property
    def chat_model_params(self) -> dict:
        return {"model": "default"}  # the suite adds max_tokens and stop itself

    @property
    def supports_json_mode(self) -> bool:
        return True


class TestChatHearthIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatHearth]:
        return ChatHearth

    @property
    def chat_model_params(self) -> dict:
        return PARAMS

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_video_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        return False

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
