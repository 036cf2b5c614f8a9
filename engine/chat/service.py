"""``ChatService``: chat requests onto an engine. The integrations (LangChain, LlamaIndex, the HTTP
server) map their types onto :class:`ChatRequest` and back from :class:`ChatResult`; everything
between (the tool-call format, ``tool_choice``, the grammar that forces a call, sampling) is here.

The chat template is not rendered here: the service sends a :class:`ChatPrompt`, which the engine
renders on its own thread (one place, the same tokenizer that tokenizes the text, no caller waits
for the model to load just to render). Only choosing the tool-call format needs the loaded model's
chat template, so only requests that offer tools without naming a format wait for the load.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model_info import ModelInfo
from ..sampling_params import SamplingParams
from ..tool_calling import normalize_tool_choice, normalize_tools, tool_choice_constraint, tool_parser_for
from ..tool_parsers import ToolParser, get_tool_parser
from .prompt import ChatPrompt
from .request import ChatRequest
from .result import ChatResult
from .stream import ChatStream

if TYPE_CHECKING:  # engine_core imports this package (ChatPrompt); a runtime import would be a circle
    from ..engine_core import EngineCore


@dataclass(slots=True)
class _Plan:
    """A request made ready for the engine, before it is queued."""

    prompt: ChatPrompt | str
    params: SamplingParams
    tool_parser: ToolParser | None


class ChatService:
    """Chat on one engine: sync or async, whole or streamed.

    >>> service = ChatService(get_engine("default"))
    >>> request = ChatRequest([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
    ...                       tool_choice="required", sampling=SamplingOptions(temperature=0))
    >>> service.chat(request).tool_calls
    [ToolCall(id='call_...', name='get_weather', arguments={'city': 'Paris'})]
    >>> for delta in service.stream(request):
    ...     print(delta.content, delta.tool_calls)
    >>> result = await service.achat(request)
    >>> async for delta in await service.astream(request):
    ...     ...

    Invalid requests raise ``ValueError`` (``TypeError`` for wrong types) before anything is queued;
    a conversation the chat template rejects raises ``ValueError`` from the stream.
    """

    def __init__(self, core: EngineCore):
        self.core = core

    def stream(self, request: ChatRequest) -> ChatStream:
        """Queue the request; its answer streams from the returned :class:`ChatStream`."""
        model_info = self.core.model_info if needs_model_info(request) else None  # waits for the load
        return self._submit(request, model_info)

    async def astream(self, request: ChatRequest) -> ChatStream:
        """:meth:`stream` for event loops: a wait for the model load happens off the loop."""
        model_info = None
        if needs_model_info(request):
            await asyncio.to_thread(self.core.wait_until_started)
            model_info = self.core.model_info
        return self._submit(request, model_info)

    def chat(self, request: ChatRequest) -> ChatResult:
        """The whole answer."""
        return self.stream(request).collect()

    async def achat(self, request: ChatRequest) -> ChatResult:
        return await (await self.astream(request)).acollect()

    def _submit(self, request: ChatRequest, model_info: ModelInfo | None) -> ChatStream:
        plan = plan_request(request, model_info)
        stream = self.core.add_request(plan.prompt, plan.params, request.request_id, request.priority,
                                       timeout=request.timeout)
        return ChatStream(stream, plan.tool_parser, plan.params.logprobs)


def needs_model_info(request: ChatRequest) -> bool:
    """Whether the tool-call format must be read from the model's chat template."""
    return bool(request.tools) and request.tool_parser is None and request.tool_choice != "none"


def plan_request(request: ChatRequest, model_info: ModelInfo | None) -> _Plan:
    """The prompt, sampling parameters and tool parser for ``request``; ``model_info`` is needed
    when :func:`needs_model_info` says so. Raises ``ValueError`` for what the engine could not serve."""
    tools = normalize_tools(request.tools) if request.tools else []
    tool_choice = normalize_tool_choice(request.tool_choice, tools)
    if tool_choice not in ("auto", "none") and not tools:
        raise ValueError(f"tool_choice={request.tool_choice!r} needs at least one tool in tools")
    offers_tools = bool(tools) and tool_choice != "none"
    tool_parser_name = _tool_parser_name(request, model_info) if offers_tools else None
    structured_output = request.structured_output
    if offers_tools and tool_choice != "auto":
        if structured_output is not None:
            raise ValueError("structured_output cannot be combined with a forced tool_choice")
        structured_output = tool_choice_constraint(tools, tool_choice, tool_parser_name)
    params = request.sampling.to_sampling_params(structured_output)
    prompt = request.messages if request.is_preformatted else ChatPrompt(
        request.messages, chat_template_kwargs=request.chat_template_kwargs, tools=tools if offers_tools else None)
    tool_parser = get_tool_parser(tool_parser_name)() if tool_parser_name is not None else None
    return _Plan(prompt, params, tool_parser)


def _tool_parser_name(request: ChatRequest, model_info: ModelInfo | None) -> str:
    if request.tool_parser is not None:
        return request.tool_parser
    if model_info is None:
        raise ValueError("choosing the tool-call format needs the model's chat template: pass model_info "
                         "(ChatService does) or name tool_parser")
    return tool_parser_for(model_info.chat_template, model_info.model_type)
