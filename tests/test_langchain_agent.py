"""One agent round trip on the default model: LangChain's ``create_agent`` calls a Python tool
through ChatHearth and answers with its result."""
from __future__ import annotations

import pytest

pytest.importorskip("langchain.agents", reason="the agent test needs langchain (the dev extra)")

from langchain.agents import create_agent  # noqa: E402
from langchain.agents.middleware import wrap_model_call  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from hearth_llm.integrations.langchain import ChatHearth  # noqa: E402


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@wrap_model_call
def call_a_tool_first(request, handler):
    """SmolLM2-135M never calls a tool on its own: force a call until a tool has answered."""
    if not any(isinstance(message, ToolMessage) for message in request.messages):
        request = request.override(tool_choice="any")
    return handler(request)


def test_agent_calls_the_tool_and_answers_with_its_result():
    agent = create_agent(ChatHearth(temperature=0, max_tokens=48), tools=[multiply], middleware=[call_a_tool_first])
    messages = agent.invoke({"messages": [HumanMessage("What is 17 times 23? Use the multiply tool.")]})["messages"]
    human, call, result, answer = messages
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("multiply", {"a": 17, "b": 23})]
    assert isinstance(result, ToolMessage) and result.content == "391"
    assert result.tool_call_id == call.tool_calls[0]["id"]
    assert isinstance(answer, AIMessage) and not answer.tool_calls and "391" in answer.content
