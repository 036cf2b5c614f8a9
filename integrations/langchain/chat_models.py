"""``ChatHearth``: a LangChain chat model served by the in-process hearth engine."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Literal

try:
    from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
except ImportError as error:  # the optional extra is missing
    raise ImportError("ChatHearth needs langchain-core: pip install 'hearth-llm[langchain]'") from error
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage, HumanMessage,
                                     SystemMessage, ToolMessage)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import ToolCallChunk, invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableGenerator, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import get_config_list
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.json import parse_partial_json
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import Field, field_validator

from hearth_llm.engine import EngineCore, Usage, get_engine
from hearth_llm.engine.chat import ChatDelta, ChatRequest, ChatService, ChatStream, SamplingOptions
from hearth_llm.engine.chat import ChatResult as HearthChatResult
from hearth_llm.engine.tool_calling import normalize_tool_choice, tool_parser_for
from hearth_llm.engine.reasoning import get_reasoning_parser
from hearth_llm.engine.tool_parsers import InvalidToolCallDelta, ToolCallDelta, get_tool_parser

PROVIDER = "hearth"
# Per-call keyword arguments (``invoke(..., temperature=0)``) that map to sampling parameters.
_SAMPLING_OPTIONS = ("temperature", "max_tokens", "top_p", "top_k", "seed", "logprobs", "top_logprobs",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "stop")
# Per-call options that are not sampling parameters: bound by bind_tools and with_structured_output.
_CALL_OPTIONS = ("tools", "tool_choice", "structured_output", "lora", "reasoning", "max_reasoning_tokens")
# Content blocks that carry no text for the model to read again (tool calls travel in ``tool_calls``).
_SKIPPED_BLOCK_TYPES = frozenset({"tool_call", "tool_call_chunk", "invalid_tool_call", "tool_use", "reasoning",
                                  "thinking"})
_STRUCTURED_OUTPUT_METHODS = ("json_schema", "function_calling", "json_mode")


class ChatHearth(BaseChatModel):
    """Chat with a local model through the hearth engine, in this process: no server, no API key.

    Setup:
        .. code-block:: bash

            pip install "hearth-llm[langchain]"

    Key init args:
        model: ``"default"`` (SmolLM2-135M-Instruct, bundled), a HF directory, a ``.gguf`` file or a hub id.
        temperature, max_tokens, top_p, top_k, stop, seed, presence_penalty, frequency_penalty,
        repetition_penalty: sampling; ``max_tokens=None`` generates until EOS, a stop string or the
            context's end. Small models loop under greedy decoding; ``repetition_penalty=1.1`` helps.
        logprobs, top_logprobs: return token log-probabilities in ``response_metadata["logprobs"]``.
        timeout: seconds per request; past it the request is aborted and ``TimeoutError`` raised.
        tool_parser: the tool-call format to read (``"hermes"``, ``"llama3_json"``, ``"mistral"``,
            ``"pythonic"``); by default chosen from the model's chat template and family.
        tool_choice: the ``tool_choice`` of calls that offer tools but name none (default ``"auto"``);
            ``"any"`` makes a model too small to call tools on its own call one every turn.
        reasoning: thinking models (Qwen3, SmolLM3, DeepSeek-R1 distills): True/False turns thinking
            on/off through the chat template's switch; None keeps the model's default. The think block
            comes back in ``additional_kwargs["reasoning_content"]`` (and as a ``reasoning`` content
            block), never in ``content``, tool calls or structured output.
        max_reasoning_tokens: a thinking budget; past it the think block is closed and the model answers.
        reasoning_parser: the think-block format (``"think"``, ``"deepseek_r1"``, ``"qwen3"``,
            ``"mistral"``); by default read from the chat template.
        lora: a LoRA adapter to answer with: a PEFT directory, the name of one the engine knows, or a
            ``LoRARequest``; per call with ``chat.bind(lora=...)``; needs ``engine_kwargs={"enable_lora":
            True}``. ``response_metadata["lora_name"]`` names the adapter that answered.
        engine_kwargs: :class:`EngineConfig` fields (``max_num_seqs``, ``kv_cache_memory``, ...).
            Every ChatHearth, ``AsyncLLM`` and ``LLM`` on the same model and config shares one
            engine, its KV cache and its prefix cache.
        keep_alive: put that shared engine to sleep after it has been idle this long (seconds, or
            ``"30s"``, ``"5m"``), as ChatOllama's ``keep_alive``; the next call wakes it. None: leave
            the engine's setting as it is (by default it never sleeps).
        speculative: speculative decoding for the engine, as ``LLM(speculative=...)``, e.g.
            ``{"method": "ngram", "num_speculative_tokens": 4}`` (RAG answers that quote their context
            decode several tokens per step); None: the engine's setting (off).

    Instantiate (cheap: the model loads on the first call):
        .. code-block:: python

            from hearth_llm.integrations.langchain import ChatHearth

            chat = ChatHearth(model="default", temperature=0, max_tokens=64)

    Invoke:
        .. code-block:: python

            messages = [("system", "You answer in one sentence."), ("human", "What is the capital of France?")]
            msg = chat.invoke(messages)
            msg.content            # 'The capital of France is Paris.'
            msg.usage_metadata     # {'input_tokens': 38, 'output_tokens': 8, 'total_tokens': 46,
                                   #  'input_token_details': {'cache_read': 32}}

    Stream:
        .. code-block:: python

            for chunk in chat.stream(messages):
                print(chunk.text, end="", flush=True)

    Async (native: no thread pool) and batch (all inputs decode together):
        .. code-block:: python

            await chat.ainvoke(messages)
            async for chunk in chat.astream(messages):
                print(chunk.text, end="")
            await chat.abatch([messages] * 32)

    Chains:
        .. code-block:: python

            from langchain_core.output_parsers import StrOutputParser
            from langchain_core.prompts import ChatPromptTemplate

            chain = ChatPromptTemplate.from_messages([("human", "Tell me about {topic}")]) | chat | StrOutputParser()
            chain.invoke({"topic": "owls"})

    Tool calling (``tool_choice="any"`` or a tool's name forces a well-formed call by grammar):
        .. code-block:: python

            from langchain_core.tools import tool

            @tool
            def get_weather(city: str) -> str:
                \"\"\"The weather in a city.\"\"\"
                return "sunny"

            msg = chat.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
            msg.tool_calls         # [{'name': 'get_weather', 'args': {'city': 'Paris'}, 'id': 'call_...', ...}]
            get_weather.invoke(msg.tool_calls[0])   # a ToolMessage for the next turn

    Structured output (the output is decoded under the schema's grammar):
        .. code-block:: python

            from pydantic import BaseModel

            class City(BaseModel):
                name: str
                country: str

            chat.with_structured_output(City).invoke("Name a city in France.")
            # City(name='Paris', country='France')

        ``method="json_schema"`` (default) constrains the output to the schema; ``"function_calling"``
        binds the schema as a tool and forces a call to it; ``"json_mode"`` allows any JSON object.
        An output cut by ``max_tokens`` before its JSON is complete raises ``OutputParserException``
        (it is never auto-closed into an object that violates the schema).

    Thinking models:
        .. code-block:: python

            chat = ChatHearth(model="Qwen/Qwen3-0.6B", reasoning=True, max_reasoning_tokens=256)
            msg = chat.invoke("What is 17 * 23?")
            msg.additional_kwargs["reasoning_content"]   # the think block
            msg.content                                  # the answer
            msg.usage_metadata["output_token_details"]   # {'reasoning': 180}
    """

    model: str = "default"
    temperature: float | None = None
    max_tokens: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    timeout: float | None = None
    streaming: bool = False
    tool_parser: str | None = None
    tool_choice: str | dict | bool | None = None
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    keep_alive: float | str | None = None
    speculative: dict[str, Any] | None = None
    # A LoRA adapter: a name the engine knows, a PEFT directory or a LoRARequest (engine_kwargs
    # enable_lora=True); per call with .bind(lora=...). response_metadata["lora_name"] names it.
    lora: Any = None
    reasoning: bool | None = None
    max_reasoning_tokens: int | None = None
    reasoning_parser: str | None = None

    @field_validator("tool_parser")
    @classmethod
    def _check_tool_parser(cls, value: str | None) -> str | None:
        if value is not None:
            get_tool_parser(value)  # raises ValueError naming tool_parser and the known formats
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _check_reasoning_parser(cls, value: str | None) -> str | None:
        if value is not None:
            get_reasoning_parser(value)  # raises ValueError naming reasoning_parser and the known formats
        return value

    @property
    def _llm_type(self) -> str:
        return "hearth-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, **{name: getattr(self, name) for name in _SAMPLING_OPTIONS},
                "engine_kwargs": self.engine_kwargs}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        options = self._options(stop, kwargs)
        params = LangSmithParams(ls_provider=PROVIDER, ls_model_name=kwargs.get("model") or self.model,
                                 ls_model_type="chat")
        if options["temperature"] is not None:
            params["ls_temperature"] = options["temperature"]
        if options["max_tokens"] is not None:
            params["ls_max_tokens"] = options["max_tokens"]
        if options["stop"]:
            params["ls_stop"] = list(options["stop"])
        return params

    # ---- tools and structured output -----------------------------------------------------------

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | dict | bool | None = None, **kwargs: Any) -> Runnable[Any, AIMessage]:
        """Offer ``tools`` to the model; its calls come back in ``AIMessage.tool_calls``.

        ``tool_choice``: ``"auto"`` (the model decides), ``"none"`` (no calls), ``"any"``/``"required"``/
        ``True`` (at least one call), a tool's name or ``{"type": "function", "function": {"name": ...}}``
        (a call to that tool). Forced calls are decoded under a grammar, so they are always well formed.

        >>> chat.bind_tools([get_weather], tool_choice="get_weather").invoke("Paris?").tool_calls[0]["name"]
        'get_weather'
        """
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = _normalize_tool_choice(tool_choice, formatted)
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type, *,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[Any, dict | Any]:
        """A runnable whose output is ``schema`` (a Pydantic model, a TypedDict or a JSON schema) filled in:
        a Pydantic instance for a Pydantic model, else a dict.

        ``method``: ``"json_schema"`` decodes under the schema's grammar; ``"function_calling"`` binds the
        schema as a tool and forces a call to it; ``"json_mode"`` allows any JSON object (say in the prompt
        which keys you want). The output always parses; ``strict`` is accepted for compatibility (the
        grammar is already strict). ``include_raw=True`` returns ``{"raw", "parsed", "parsing_error"}``.

        >>> chat.with_structured_output(City).invoke("Name a city in France.")
        City(name='Paris', country='France')
        """
        if kwargs:
            raise ValueError(f"with_structured_output got unknown argument(s) {sorted(kwargs)}")
        if method not in _STRUCTURED_OUTPUT_METHODS:
            raise ValueError(f"method must be one of {list(_STRUCTURED_OUTPUT_METHODS)}, got {method!r}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        trace_format = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        if method == "function_calling":
            tool = convert_to_openai_tool(schema, strict=strict)
            name = tool["function"]["name"]
            llm = self.bind_tools([tool], tool_choice=name, ls_structured_output_format=trace_format)
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        else:
            # json_mode: any object. Said as a schema because the engine's json_object grammar admits arrays too.
            guide = {"json": convert_to_json_schema(schema) if method == "json_schema" else {"type": "object"}}
            llm = self.bind(structured_output=guide, ls_structured_output_format=trace_format)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        parser = _refuse_cut_output | parser
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")

    # ---- the four native paths ---------------------------------------------------------------

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._prepare(messages, stop, kwargs)
        wants_tokens = run_manager is not None and bool(run_manager.handlers)
        with call.stream() as stream:
            for delta in stream:
                if wants_tokens and delta.text:
                    run_manager.on_llm_new_token(delta.text, chunk=call.chunk(delta))
        return call.result(stream.result)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._prepare(messages, stop, kwargs)
        wants_tokens = run_manager is not None and bool(run_manager.handlers)
        with await call.astream() as stream:
            async for delta in stream:
                if wants_tokens and delta.text:
                    await run_manager.on_llm_new_token(delta.text, chunk=call.chunk(delta))
        return call.result(stream.result)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, kwargs)
        with call.stream() as stream:  # leaving early aborts the request at once
            for delta in stream:
                chunk = call.chunk(delta)
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, kwargs)
        with await call.astream() as stream:
            async for delta in stream:
                chunk = call.chunk(delta)
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def batch(self, inputs: list[Any], config: RunnableConfig | list[RunnableConfig] | None = None, *,
              return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Like ``Runnable.batch``, but with every input in flight at once (the default thread
        pool would feed the engine a few at a time); the engine decodes them in shared steps."""
        configs = [{**c, "max_concurrency": c.get("max_concurrency") or len(inputs)}
                   for c in get_config_list(config, len(inputs))]
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    # ---- mapping ------------------------------------------------------------------------------

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        options = {name: getattr(self, name) for name in _SAMPLING_OPTIONS}
        options.update({name: value for name, value in kwargs.items() if name in options})
        if stop is not None:
            options["stop"] = stop
        return options

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Call:
        kwargs = dict(kwargs)
        kwargs.pop("stream", None)  # LangChain's own switch, already acted on
        model = kwargs.pop("model", None) or self.model
        unknown = sorted(set(kwargs) - set(_SAMPLING_OPTIONS) - set(_CALL_OPTIONS))
        if unknown:
            raise TypeError(f"ChatHearth got unknown call option(s) {unknown}; "
                            f"known: {['model', *_SAMPLING_OPTIONS, *_CALL_OPTIONS]}")
        tools = [convert_to_openai_tool(tool) for tool in kwargs.pop("tools", None) or []]
        tool_choice = kwargs.pop("tool_choice", None)
        tool_choice = _normalize_tool_choice(self.tool_choice if tool_choice is None else tool_choice, tools)
        request = ChatRequest(to_chat_messages(messages), tools=tools or None,
                              tool_choice=tool_choice if tools else None,  # the field applies to calls with tools
                              structured_output=kwargs.pop("structured_output", None),
                              sampling=SamplingOptions(**self._options(stop, kwargs)),
                              tool_parser=self.tool_parser, timeout=self.timeout,
                              lora_request=kwargs.pop("lora", self.lora),
                              reasoning=kwargs.pop("reasoning", self.reasoning),
                              max_reasoning_tokens=kwargs.pop("max_reasoning_tokens", self.max_reasoning_tokens),
                              reasoning_parser=self.reasoning_parser)
        keep_alive = {} if self.keep_alive is None else {"keep_alive": self.keep_alive}
        speculative = {} if self.speculative is None else {"speculative": self.speculative}
        core = get_engine(model, **{"show_progress": False, **self.engine_kwargs, **keep_alive, **speculative})
        return _Call(ChatService(core), request, model)


def _tool_parser_for(core: EngineCore) -> str:
    """The tool-call format read for ``core``'s model (see ``engine.tool_calling.tool_parser_for``)."""
    model_info = getattr(core, "model_info", None)  # waits for the model to load
    if model_info is not None:
        return tool_parser_for(model_info.chat_template, model_info.model_type)
    # The stand-in of tests/test_chat_hearth_tools.py has only a tokenizer and an HF config.
    return tool_parser_for(core.tokenizer.chat_template, getattr(core.engine.hf_config, "model_type", None))


def _normalize_tool_choice(tool_choice: str | dict | bool | None, tools: list[dict]) -> str:
    """``"auto"``, ``"none"``, ``"any"`` (LangChain's word for a required call) or the name of one of ``tools``."""
    tool_choice = normalize_tool_choice(tool_choice, tools)
    return "any" if tool_choice == "required" else tool_choice


@dataclass(slots=True)
class _Call:
    """One request: what to ask the chat service, and how its answer reads in LangChain's types."""

    service: ChatService
    request: ChatRequest
    model_name: str
    streamed_arguments: dict[int, str] = field(default_factory=dict)  # per tool call index, for chunks

    def stream(self) -> ChatStream:
        return self.service.stream(self.request)

    async def astream(self) -> ChatStream:
        return await self.service.astream(self.request)

    def chunk(self, delta: ChatDelta) -> ChatGenerationChunk:
        tool_call_chunks = [self._tool_call_chunk(event) for event in delta.tool_calls]
        metadata = _logprobs_metadata(delta.logprobs)
        # Merged chunks concatenate additional_kwargs strings: the reasoning arrives whole in the sum.
        reasoning = {"reasoning_content": delta.reasoning} if delta.reasoning else {}
        if delta.result is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=delta.content, tool_call_chunks=tool_call_chunks,
                                                              response_metadata=metadata, additional_kwargs=reasoning))
        message = AIMessageChunk(content=delta.content, tool_call_chunks=tool_call_chunks,
                                 usage_metadata=_usage_metadata(delta.result.usage),
                                 response_metadata={**metadata, **self._final_metadata(delta.result)},
                                 additional_kwargs=reasoning, chunk_position="last")
        return ChatGenerationChunk(message=message)

    def result(self, result: HearthChatResult) -> ChatResult:
        message = AIMessage(
            content=result.content,
            tool_calls=[tool_call(name=call.name, args=call.arguments, id=call.id) for call in result.tool_calls],
            invalid_tool_calls=[invalid_tool_call(name=call.name, args=call.raw_arguments, id=call.id,
                                                  error=call.error) for call in result.invalid_tool_calls],
            usage_metadata=_usage_metadata(result.usage),
            additional_kwargs={"reasoning_content": result.reasoning} if result.reasoning else {},
            response_metadata={**_logprobs_metadata(result.logprobs), **self._final_metadata(result)})
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _tool_call_chunk(self, event: ToolCallDelta | InvalidToolCallDelta) -> ToolCallChunk:
        index = event.index
        if isinstance(event, ToolCallDelta):
            self.streamed_arguments[index] = self.streamed_arguments.get(index, "") + event.arguments_fragment
            return tool_call_chunk(name=event.name, args=event.arguments_fragment, id=event.id, index=index)
        if index in self.streamed_arguments:  # its start went out already: make the merged whole unreadable
            return tool_call_chunk(args=_unreadable_tail(self.streamed_arguments[index]), index=index)
        call = event.invalid_tool_call
        raw = call.raw_arguments or ""
        return tool_call_chunk(name=call.name, args=raw + _unreadable_tail(raw), id=call.id, index=index)

    def _final_metadata(self, result: HearthChatResult) -> dict[str, Any]:
        metadata = {"model_name": self.model_name, "model_provider": PROVIDER, "finish_reason": result.finish_reason,
                    "stop_reason": result.stop_reason}
        if self.request.lora_request is not None:
            metadata["lora_name"] = self.request.lora_request.name  # the adapter that answered
        return metadata


def _cut_output_error(message: BaseMessage) -> OutputParserException | None:
    """The error for structured output that ``max_tokens`` (or the context's end) cut short: its
    JSON would only parse auto-closed, as an object the schema may not admit."""
    if message.response_metadata.get("finish_reason") != "length":
        return None
    usage = getattr(message, "usage_metadata", None) or {}
    return OutputParserException(
        f"the structured output was cut after {usage.get('output_tokens', '?')} tokens by max_tokens (or the end of "
        f"the context) before it was complete (finish_reason='length'); raise max_tokens or leave it None",
        llm_output=message.text)


def _refuse_cut_message(chunks: Iterator[BaseMessage]) -> Iterator[BaseMessage]:
    for chunk in chunks:
        yield chunk
        if (error := _cut_output_error(chunk)) is not None:  # the last chunk carries the finish reason
            raise error


async def _arefuse_cut_message(chunks: AsyncIterator[BaseMessage]) -> AsyncIterator[BaseMessage]:
    async for chunk in chunks:
        yield chunk
        if (error := _cut_output_error(chunk)) is not None:
            raise error


# Passes the model's message (or chunks) on to the structured-output parser, raising for a cut one.
_refuse_cut_output = RunnableGenerator(_refuse_cut_message, _arefuse_cut_message, name="refuse_cut_output")


def _unreadable_tail(arguments: str) -> str:
    """A suffix after which LangChain's merge of streamed chunks reads ``arguments`` as invalid.

    Merged chunks are re-read with a lenient partial-JSON parser that closes whatever is open, so a
    call that turned out malformed would merge into a valid-looking one. A closing bracket that
    matches nothing (after closing an open string) makes that read fail, and the merged message
    then lists the call under ``invalid_tool_calls``, as ``invoke`` does.
    """
    for tail in ('"]', '"}', "]", "}"):  # one of them always works: a bracket mismatched outside a string
        try:
            if not isinstance(parse_partial_json(arguments + tail), dict):
                return tail
        except ValueError:
            return tail
    return ""


def _logprobs_metadata(logprobs: list[dict] | None) -> dict[str, Any]:
    return {} if logprobs is None else {"logprobs": {"content": logprobs}}


def _usage_metadata(usage: Usage | None) -> UsageMetadata | None:
    if usage is None:
        return None
    metadata = UsageMetadata(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                             total_tokens=usage.total_tokens, input_token_details={"cache_read": usage.cached_tokens})
    reasoning_tokens = getattr(usage, "reasoning_tokens", 0)  # a ChatUsage when the model has a reasoning format
    if reasoning_tokens:
        metadata["output_token_details"] = {"reasoning": reasoning_tokens}
    return metadata


def to_chat_messages(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the ``{"role", "content", ...}`` dicts that chat templates read.

    >>> to_chat_messages([SystemMessage("Be brief."), HumanMessage("Hi")])
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
    """
    return [_to_chat_message(message) for message in messages]


def _to_chat_message(message: BaseMessage) -> dict[str, Any]:
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": _text_of(message)}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": _text_of(message)}
    if isinstance(message, AIMessage):
        entry: dict[str, Any] = {"role": "assistant", "content": _text_of(message)}
        if message.tool_calls:
            entry["tool_calls"] = [{"id": call.get("id"), "type": "function",
                                    "function": {"name": call["name"], "arguments": call["args"]}}
                                   for call in message.tool_calls]
        return entry
    if isinstance(message, ToolMessage):
        entry = {"role": "tool", "content": _text_of(message), "tool_call_id": message.tool_call_id}
        if message.name:
            entry["name"] = message.name
        return entry
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": _text_of(message)}
    raise ValueError(f"ChatHearth cannot send a {type(message).__name__}; use System/Human/AI/Tool/ChatMessage")


def _text_of(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif block.get("type") not in _SKIPPED_BLOCK_TYPES:
            raise ValueError(f"ChatHearth takes text only; got a {block.get('type')!r} content block")
    return "".join(parts)
