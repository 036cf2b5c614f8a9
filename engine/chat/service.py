"""``ChatService``: chat requests onto an engine. The integrations (LangChain, LlamaIndex, the HTTP
server) map their types onto :class:`ChatRequest` and back from :class:`ChatResult`; everything
between (the tool-call format, ``tool_choice``, the grammar that forces a call, sampling) is here.

The chat template is not rendered here: the service sends a :class:`ChatPrompt`, which the engine
renders on its own thread (one place, the same tokenizer that tokenizes the text, no caller waits
for the model to load just to render). Only choosing the tool-call format, the template's thinking
switch, or a thinking plan (a budget, or a grammar after the think block) needs the loaded model, so
only such requests wait for the load; the reasoning format of any other request is read from the
model once its first output arrives.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model_info import ModelInfo
from ..reasoning import (ReasoningParser, get_reasoning_parser, prompt_opens_block, select_reasoning_parser,
                         template_opens_block, thinking_switch)
from ..sampling_params import SamplingParams
from ..tool_calling import normalize_tool_choice, normalize_tools, tool_choice_constraint, tool_parser_for
from ..tool_parsers import ToolParser, get_tool_parser
from .prompt import ChatPrompt, render_chat_prompt
from .request import ChatRequest
from .result import ChatResult
from .stream import ChatStream
from .thinking import ThinkingPlan, ThinkingStream

if TYPE_CHECKING:  # engine_core imports this package (ChatPrompt); a runtime import would be a circle
    from ..engine_core import EngineCore


@dataclass(slots=True)
class _Plan:
    """A request made ready for the engine, before it is queued."""

    prompt: ChatPrompt | str
    params: SamplingParams
    tool_parser: ToolParser | None
    reasoning_parser: ReasoningParser | None = None
    # The reasoning format is read from the model when the first output arrives (no model info yet).
    reads_reasoning_later: bool = False
    # Think, then answer, in two requests (see .thinking); needs the tokenizer, so built on submit.
    thinks_first: bool = False


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
        if plan.thinks_first:
            return self._submit_thinking(request, plan)
        stream = self.core.add_request(plan.prompt, plan.params, request.request_id, request.priority,
                                       timeout=request.timeout, **_adapter(request))
        reasoning_parser = plan.reasoning_parser
        if plan.reads_reasoning_later:
            def reasoning_parser() -> ReasoningParser | None:  # asked when the first output arrives
                return reasoning_parser_for(request, plan.prompt, _loaded_model_info(self.core))
        return ChatStream(stream, plan.tool_parser, plan.params.logprobs, reasoning_parser)

    def _submit_thinking(self, request: ChatRequest, plan: _Plan) -> ChatStream:
        """Think, then answer (see :mod:`.thinking`); the prompt is sent with its think block open."""
        tokenizer = self.core.tokenizer  # loaded: planning a thinking request needed the model
        parser = plan.reasoning_parser
        prompt = plan.prompt if isinstance(plan.prompt, str) else render_chat_prompt(tokenizer, plan.prompt)
        if not prompt_opens_block(prompt, parser.start_tag, parser.end_tag):
            prompt += f"{parser.start_tag}\n"
        thinking = ThinkingPlan.build(plan.params, request.max_reasoning_tokens, tokenizer, parser.end_tag)
        first = self.core.add_request(prompt, thinking.thinking_params, request.request_id, request.priority,
                                      timeout=request.timeout, **_adapter(request))
        stream = ThinkingStream(self.core, first, thinking, request.priority, request.timeout, _adapter(request))
        return ChatStream(stream, plan.tool_parser, plan.params.logprobs, type(parser)(starts_in_reasoning=True))


def needs_model_info(request: ChatRequest) -> bool:
    """Whether planning needs the loaded model: to read the tool-call format or the thinking switch
    from its chat template, or to plan thinking before a budget or a grammar."""
    offers_tools = bool(request.tools) and request.tool_choice != "none"
    if offers_tools and request.tool_parser is None:
        return True
    if request.reasoning is not None and not request.is_preformatted:
        return True  # the template's switch
    has_grammar = request.structured_output is not None or (offers_tools and request.tool_choice not in (None, "auto"))
    return request.reasoning is not False and (request.max_reasoning_tokens is not None or has_grammar)


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
        request.messages, chat_template_kwargs=_template_kwargs(request, model_info),
        tools=tools if offers_tools else None)
    tool_parser = get_tool_parser(tool_parser_name)() if tool_parser_name is not None else None
    # Without the model's facts, whether its template opens the think block is not known either.
    if model_info is None and not (request.is_preformatted and request.reasoning_parser is not None):
        if request.max_reasoning_tokens is not None:
            raise ValueError("max_reasoning_tokens needs the model's chat template: pass model_info "
                             "(ChatService does)")
        return _Plan(prompt, params, tool_parser, reads_reasoning_later=request.reasoning is not False)
    reasoning_parser = reasoning_parser_for(request, prompt, model_info)
    if reasoning_parser is None and request.max_reasoning_tokens is not None:
        raise ValueError("max_reasoning_tokens: this model's chat template shows no think block; name its format "
                         "with reasoning_parser (e.g. 'think') if it thinks anyway")
    thinks_first = reasoning_parser is not None and request.reasoning is not False and (
        request.max_reasoning_tokens is not None or params.structured_output is not None)
    return _Plan(prompt, params, tool_parser, reasoning_parser, thinks_first=thinks_first)


def reasoning_parser_for(request: ChatRequest, prompt: ChatPrompt | str,
                         model_info: ModelInfo | None) -> ReasoningParser | None:
    """The parser that splits the think block from the answer; None for a model that does not think.

    ``reasoning=True`` on a model whose template shows no reasoning format raises ``ValueError``.
    """
    name = request.reasoning_parser
    chat_template = model_info.chat_template if model_info is not None else None
    if name is None:
        name = select_reasoning_parser(chat_template)
    if name is None:
        if request.reasoning is True:
            raise ValueError("reasoning=True: this model's chat template shows no think block; name its "
                             "format with reasoning_parser (e.g. 'think') if it thinks anyway")
        return None
    parser_class = get_reasoning_parser(name)
    if isinstance(prompt, str):
        opens = prompt_opens_block(prompt, parser_class.start_tag, parser_class.end_tag)
    else:
        opens = chat_template is not None and template_opens_block(
            chat_template, prompt.messages, prompt.chat_template_kwargs, parser_class.start_tag, parser_class.end_tag)
    return parser_class(starts_in_reasoning=opens)


def _template_kwargs(request: ChatRequest, model_info: ModelInfo | None) -> dict | None:
    """``chat_template_kwargs`` with ``reasoning`` as the template's switch (the caller's own entries win)."""
    switch = thinking_switch(model_info.chat_template) if model_info is not None else None
    if request.reasoning is None or switch is None:
        return request.chat_template_kwargs
    return {switch: request.reasoning, **(request.chat_template_kwargs or {})}


def _adapter(request: ChatRequest) -> dict:
    """The LoRA adapter a request names, for every engine request it makes."""
    return {} if request.lora_request is None else {"lora_request": request.lora_request}


def _loaded_model_info(core) -> ModelInfo | None:
    """The model's facts once it has loaded; a stand-in core (tests) may have none."""
    return getattr(core, "model_info", None)


def _tool_parser_name(request: ChatRequest, model_info: ModelInfo | None) -> str:
    if request.tool_parser is not None:
        return request.tool_parser
    if model_info is None:
        raise ValueError("choosing the tool-call format needs the model's chat template: pass model_info "
                         "(ChatService does) or name tool_parser")
    return tool_parser_for(model_info.chat_template, model_info.model_type)
