"""LangChain's standard chat model integration suite (langchain-tests) for ``ChatOpenAI`` pointed at
our server: the OpenAI wire format as LangChain's own OpenAI class reads it, tools and structured
output included. Parameters as tests/test_langchain_standard.py uses for ChatHearth (greedy, mild
penalties so SmolLM2-135M's strings end); multimodal inputs are declared unsupported.

This suite takes ~6 minutes on two shared cores (every test asks the 135M model for up to 128 tokens)."""
from __future__ import annotations

import httpx
import pytest
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

from hearth_llm.server import start_server

KEY = "sk-standard-suite"
_SERVER = {}


@pytest.fixture(scope="module", autouse=True)
def server():
    running = start_server("default", api_key=KEY, embedding_model=None, dtype="float32")
    _SERVER["url"] = running.url
    yield running
    running.stop()


class TestChatOpenAIOnHearthServer(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        return {"base_url": _SERVER["url"], "api_key": KEY, "model": "default", "temperature": 0,
                "max_tokens": 128, "frequency_penalty": 0.5, "extra_body": {"repetition_penalty": 1.05},
                "max_retries": 0, "stream_usage": True,
                # one async client per model: langchain-openai's shared default is bound to the first
                # event loop that used it, and each async test here runs on a loop of its own
                "http_async_client": httpx.AsyncClient(timeout=120)}

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
        return "SmolLM2-135M-Instruct"  # the served name: the same model

    @pytest.mark.xfail(reason="SmolLM2-135M does not call a tool unless tool_choice forces one, and this test binds "
                              "tools with tool_choice='auto' (ChatHearth's suite forces calls by its tool_choice "
                              "default; ChatOpenAI has none)", strict=True)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)
