"""``HearthLLM``: a LlamaIndex function-calling LLM served by the in-process hearth engine."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen,
                                              CompletionResponse, CompletionResponseAsyncGen, CompletionResponseGen,
                                              LLMMetadata, MessageRole, TextBlock, ThinkingBlock, ToolCallBlock)
from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.tools.types import BaseTool
from pydantic import Field

from hearth_llm.engine import ChatPrompt, EngineCore, RequestStream, SamplingParams, StreamOutput, get_engine
from hearth_llm.engine.structured_output import StructuredOutput
from hearth_llm.engine.tool_calling import template_supports_tools, tool_choice_constraint
from hearth_llm.engine.tool_parsers import ContentDelta, ToolParser, get_tool_parser, select_tool_parser

# Per-call keyword arguments (``chat(messages, temperature=0)``) that map to sampling parameters.
_SAMPLING_OPTIONS = ("temperature", "max_tokens", "top_p", "top_k", "stop", "seed", "presence_penalty",
                     "frequency_penalty")
# LlamaIndex roles that chat templates know under another name.
_ROLE_NAMES = {"developer": "system", "chatbot": "assistant", "model": "assistant", "function": "tool"}


class HearthLLM(FunctionCallingLLM):
    """Chat, complete and call tools with a local model through the hearth engine, in this process.

    >>> from hearth_llm.integrations.llama_index import HearthLLM
    >>> llm = HearthLLM(model="default", temperature=0, max_tokens=64)   # cheap: loads on first use
    >>> llm.complete("What is the capital of France?").text
    'The capital of France is Paris.'
    >>> for chunk in llm.stream_chat([ChatMessage(role="user", content="Hi!")]):
    ...     print(chunk.delta, end="")
    >>> await llm.achat(messages); await llm.astream_complete("Tell me about owls")   # native async

    RAG and agents:

    >>> from llama_index.core import Settings, VectorStoreIndex
    >>> Settings.llm, Settings.embed_model = HearthLLM(temperature=0), HearthEmbedding()
    >>> VectorStoreIndex.from_documents(docs).as_query_engine(streaming=True).query("...").print_response_stream()
    >>> agent = FunctionAgent(tools=[multiply], llm=llm, initial_tool_choice="multiply")
    >>> await agent.run("What is 6 times 7?")

    Tool calls and structured output (``tool_required=True`` and a named ``tool_choice`` are
    enforced by grammar, so even a 135M model emits a well-formed call with valid arguments):

    >>> response = llm.chat_with_tools([multiply_tool], user_msg="6 times 7?", tool_required=True)
    >>> llm.get_tool_calls_from_response(response)        # [ToolSelection(tool_name='multiply', ...)]
    >>> llm.structured_predict(City, PromptTemplate("Name a city in {country}."), country="France")

    ``model`` is ``"default"`` (SmolLM2-135M-Instruct, bundled), a HF directory, a ``.gguf`` file or a
    hub id; ``engine_kwargs`` are :class:`EngineConfig` fields. Every HearthLLM, ChatHearth,
    ``AsyncLLM`` and ``LLM`` on the same model and config shares one engine and its prefix cache.
    ``complete`` renders the prompt as one user turn of the chat template; ``formatted=True`` sends it raw.
    """

    model: str = Field(default="default", description="'default' (SmolLM2-135M-Instruct), a dir, .gguf or hub id.")
    temperature: float | None = Field(default=None, description="0 is greedy; None keeps the engine's default.")
    max_tokens: int | None = Field(default=None, description="Most new tokens; None: until EOS, a stop or the end.")
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    timeout: float | None = Field(default=None, description="Seconds per request; past it the request is aborted.")
    context_window: int | None = Field(default=None, description="None: the engine's max_model_len.")
    tool_parser: str | None = Field(default=None, description="Tool-call format; None: read from the chat template.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields.")

    @classmethod
    def class_name(cls) -> str:
        return "HearthLLM"

    @property
    def core(self) -> EngineCore:
        """The shared engine; the same object ChatHearth gets for this model and config."""
        return get_engine(self.model, **{"show_progress": False, **self.engine_kwargs})

    @property
    def metadata(self) -> LLMMetadata:
        """Reads the context window from the engine, so the first access loads the model."""
        return LLMMetadata(context_window=self.context_window or self.core.engine.max_model_len,
                           num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS, is_chat_model=True,
                           is_function_calling_model=True, model_name=self.model)

    # ---- chat ---------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        call = self._prepare_chat(messages, kwargs)
        if call.needs_tool_parser:
            call.resolve_tool_parser()
        with call.submit() as stream:
            return call.chat_response(list(stream))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        call = self._prepare_chat(messages, kwargs)
        if call.needs_tool_parser:
            await call.aresolve_tool_parser()
        with call.submit() as stream:
            return call.chat_response([output async for output in stream])

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        call = self._prepare_chat(messages, kwargs)

        def chunks() -> Iterator[ChatResponse]:
            if call.needs_tool_parser:
                call.resolve_tool_parser()
            chunker = call.chat_chunker()
            with call.submit() as stream:  # leaving early aborts the request at once
                for output in stream:
                    yield chunker.next(output)
        return chunks()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        call = self._prepare_chat(messages, kwargs)

        async def chunks() -> AsyncIterator[ChatResponse]:
            if call.needs_tool_parser:
                await call.aresolve_tool_parser()
            chunker = call.chat_chunker()
            with call.submit() as stream:
                async for output in stream:
                    yield chunker.next(output)
        return chunks()

    # ---- complete -----------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        call = self._prepare_completion(prompt, formatted, kwargs)
        with call.submit() as stream:
            return call.completion_response(list(stream))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        call = self._prepare_completion(prompt, formatted, kwargs)
        with call.submit() as stream:
            return call.completion_response([output async for output in stream])

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        call = self._prepare_completion(prompt, formatted, kwargs)

        def chunks() -> Iterator[CompletionResponse]:
            text = ""
            with call.submit() as stream:
                for output in stream:
                    text += output.delta_text
                    yield call.completion_chunk(text, output)
        return chunks()

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        call = self._prepare_completion(prompt, formatted, kwargs)

        async def chunks() -> AsyncIterator[CompletionResponse]:
            text = ""
            with call.submit() as stream:
                async for output in stream:
                    text += output.delta_text
                    yield call.completion_chunk(text, output)
        return chunks()

    # ---- tools --------------------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``tool_choice``: ``"auto"``, ``"none"``, ``"required"`` or a tool name; ``tool_required``
        means ``"required"`` unless a tool is named."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        if tool_choice is None:
            tool_choice = "required" if tool_required else "auto"
        return {"messages": messages, "tools": [tool.metadata.to_openai_tool() for tool in tools],
                "tool_choice": tool_choice, **kwargs}

    def _validate_chat_with_tools_response(self, response: ChatResponse, tools: Sequence[BaseTool],
                                           allow_parallel_tool_calls: bool = False, **kwargs: Any) -> ChatResponse:
        if allow_parallel_tool_calls:
            return response
        blocks, has_call = [], False
        for block in response.message.blocks:  # keep the first call only
            if isinstance(block, ToolCallBlock):
                if has_call:
                    continue
                has_call = True
            blocks.append(block)
        response.message.blocks = blocks
        return response

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        calls = [ToolSelection(tool_id=block.tool_call_id or "", tool_name=block.tool_name,
                               tool_kwargs=block.tool_kwargs if isinstance(block.tool_kwargs, dict) else {})
                 for block in response.message.blocks if isinstance(block, ToolCallBlock)]
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call in the response, got none: "
                             f"{response.message.content!r}")
        return calls

    # ---- mapping ------------------------------------------------------------------------------

    def _prepare_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> _Call:
        kwargs = dict(kwargs)
        tools, tool_choice = kwargs.pop("tools", None) or None, kwargs.pop("tool_choice", "auto")
        if tool_choice == "none":
            tools = None
        elif not tools and tool_choice != "auto":
            raise ValueError(f"tool_choice={tool_choice!r} needs at least one tool in tools")
        return self._new_call(ChatPrompt(to_chat_messages(messages), tools=tools), kwargs, tools, tool_choice)

    def _prepare_completion(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> _Call:
        engine_prompt = prompt if formatted else ChatPrompt([{"role": "user", "content": prompt}])
        return self._new_call(engine_prompt, kwargs)

    def _new_call(self, prompt: ChatPrompt | str, kwargs: dict[str, Any], tools: list[dict] | None = None,
                  tool_choice: str | dict = "auto") -> _Call:
        unknown = sorted(set(kwargs) - set(_SAMPLING_OPTIONS))
        if unknown:
            raise TypeError(f"HearthLLM got unknown call option(s) {unknown}; known: "
                            f"{['tools', 'tool_choice', *_SAMPLING_OPTIONS]}")
        options = {name: kwargs.get(name, getattr(self, name)) for name in _SAMPLING_OPTIONS}
        return _Call(self.core, prompt, options, self.model, self.timeout, tools, tool_choice, self.tool_parser)


@dataclass(slots=True)
class _Call:
    """One request: what to send to the engine, and how to turn its outputs into LlamaIndex's types."""

    core: EngineCore
    prompt: ChatPrompt | str
    options: dict[str, Any]
    model_name: str
    timeout: float | None
    tools: list[dict] | None
    tool_choice: str | dict
    tool_parser_name: str | None           # None: chosen from the chat template once the model is loaded
    tool_parser: ToolParser | None = None  # set when tools are offered

    @property
    def needs_tool_parser(self) -> bool:
        return bool(self.tools)

    def resolve_tool_parser(self) -> None:
        """Pick the tool-call format; unless named, it comes from the loaded tokenizer's template."""
        name = self.tool_parser_name
        if name is None:
            tokenizer = self.core.tokenizer  # waits for the model to load
            # A template that knows nothing of tools gets the hermes system prompt (see tool_calling).
            name = "hermes" if not template_supports_tools(tokenizer) else select_tool_parser(
                tokenizer.chat_template, getattr(self.core.engine.hf_config, "model_type", None))
        self.tool_parser = get_tool_parser(name)()
        self.tool_parser_name = name

    async def aresolve_tool_parser(self) -> None:
        if self.tool_parser_name is None:
            # Loading the model takes seconds; wait for it off the event loop.
            await asyncio.to_thread(self.core.wait_until_started)
        self.resolve_tool_parser()

    def submit(self) -> RequestStream:
        constraint = tool_choice_constraint(self.tools, self.tool_choice, self.tool_parser_name) if self.tools else None
        return self.core.add_request(self.prompt, _sampling_params(self.options, constraint), timeout=self.timeout)

    def chat_response(self, outputs: list[StreamOutput]) -> ChatResponse:
        last = outputs[-1]
        return ChatResponse(message=self._message("".join(output.delta_text for output in outputs)),
                            raw=self._raw(last), additional_kwargs=_usage_kwargs(last))

    def chat_chunker(self) -> _ChatChunker:
        return _ChatChunker(self)

    def completion_response(self, outputs: list[StreamOutput]) -> CompletionResponse:
        last = outputs[-1]
        return CompletionResponse(text="".join(output.delta_text for output in outputs), raw=self._raw(last),
                                  additional_kwargs=_usage_kwargs(last))

    def completion_chunk(self, text: str, output: StreamOutput) -> CompletionResponse:
        if not output.finished:
            return CompletionResponse(text=text, delta=output.delta_text)
        return CompletionResponse(text=text, delta=output.delta_text, raw=self._raw(output),
                                  additional_kwargs=_usage_kwargs(output))

    def _message(self, text: str) -> ChatMessage:
        if self.tool_parser is None:
            return ChatMessage(role=MessageRole.ASSISTANT, content=text)
        parsed = self.tool_parser.parse(text)
        blocks = [TextBlock(text=parsed.content)]
        blocks += [ToolCallBlock(tool_call_id=call.id, tool_name=call.name, tool_kwargs=call.arguments)
                   for call in parsed.tool_calls]
        extra = {"invalid_tool_calls": [{"id": bad.id, "name": bad.name, "raw": bad.raw_arguments, "error": bad.error}
                                        for bad in parsed.invalid_tool_calls]} if parsed.invalid_tool_calls else {}
        return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)

    def _raw(self, last: StreamOutput) -> dict[str, Any]:
        return {"model": self.model_name, "finish_reason": last.finish_reason, "stop_reason": last.stop_reason,
                "usage": _usage_kwargs(last)}


class _ChatChunker:
    """Streamed chat responses: ``delta`` is the new user-facing text, ``message`` all of it so far;
    with tools offered, call markup is held out of the text and the calls arrive on the last chunk."""

    def __init__(self, call: _Call):
        self._call = call
        self._streamer = call.tool_parser.streamer() if call.tool_parser is not None else None
        self._text = ""
        self._content = ""

    def next(self, output: StreamOutput) -> ChatResponse:
        self._text += output.delta_text
        delta = output.delta_text
        if self._streamer is not None:
            events = self._streamer.feed(output.delta_text) + (self._streamer.finish() if output.finished else [])
            delta = "".join(event.text for event in events if isinstance(event, ContentDelta))
        self._content += delta
        if not output.finished:
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=self._content), delta=delta)
        return ChatResponse(message=self._call._message(self._text), delta=delta, raw=self._call._raw(output),
                            additional_kwargs=_usage_kwargs(output))


def _sampling_params(options: dict[str, Any], structured_output: StructuredOutput | None) -> SamplingParams:
    values = {name: options[name] for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty",
                                               "frequency_penalty") if options[name] is not None}
    values["max_tokens"] = options["max_tokens"]  # None: until EOS, a stop or the end of the context
    values["stop"] = list(options["stop"]) if options["stop"] else None
    return SamplingParams(**values, structured_output=structured_output)


def _usage_kwargs(last: StreamOutput) -> dict[str, int]:
    usage = last.usage
    if usage is None:
        return {}
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "cached_tokens": usage.cached_tokens}


def to_chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex messages as the ``{"role", "content", ...}`` dicts that chat templates read;
    ``ToolCallBlock``s become ``tool_calls`` and a tool message keeps its ``tool_call_id``.

    >>> to_chat_messages([ChatMessage(role="system", content="Be brief."), ChatMessage(content="Hi")])
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
    """
    return [_to_chat_message(message) for message in messages]


def _to_chat_message(message: ChatMessage) -> dict[str, Any]:
    role = _ROLE_NAMES.get(message.role.value, message.role.value)
    texts, calls = [], []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolCallBlock):
            calls.append({"id": block.tool_call_id, "type": "function",
                          "function": {"name": block.tool_name, "arguments": block.tool_kwargs}})
        elif not isinstance(block, ThinkingBlock):  # thoughts are not shown to the model again
            raise ValueError(f"HearthLLM takes text only; got a {type(block).__name__} in a {role} message")
    entry: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    if calls:
        entry["tool_calls"] = calls
    if role == "tool" and message.additional_kwargs.get("tool_call_id"):
        entry["tool_call_id"] = message.additional_kwargs["tool_call_id"]
    return entry


__all__ = ["HearthLLM", "to_chat_messages"]
