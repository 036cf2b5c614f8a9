"""``HearthLLM``: a LlamaIndex function-calling LLM served by the in-process hearth engine."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen,
                                              CompletionResponse, CompletionResponseAsyncGen, CompletionResponseGen,
                                              LLMMetadata, MessageRole, TextBlock, ThinkingBlock, ToolCallBlock)
from llama_index.core.base.llms.generic_utils import (astream_chat_response_to_completion_response,
                                                      chat_response_to_completion_response,
                                                      stream_chat_response_to_completion_response)
from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.tools.types import BaseTool
from pydantic import Field

from hearth_llm.engine import EngineCore, get_engine
from hearth_llm.engine.chat import ChatDelta, ChatRequest, ChatService, SamplingOptions
from hearth_llm.engine.chat import ChatResult as HearthChatResult

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
    ``lora``: a LoRA adapter to answer with (a name the engine knows, a PEFT directory or a
    ``LoRARequest``; needs ``engine_kwargs={"enable_lora": True}``), per call as ``llm.chat(..., lora=...)``;
    ``response.raw["lora_name"]`` names it.

    Thinking models (Qwen3, SmolLM3, DeepSeek-R1 distills): ``thinking`` True/False turns thinking on/off
    through the chat template's switch (None: the model's default); the think block comes back as a
    ``ThinkingBlock`` of the message (streamed as ``additional_kwargs["thinking_delta"]``), never in
    ``content`` or tool calls; ``max_reasoning_tokens`` closes it after that many tokens.

    >>> llm = HearthLLM(model="Qwen/Qwen3-0.6B", thinking=True, max_reasoning_tokens=256)
    >>> response = llm.chat([ChatMessage(role="user", content="17 * 23?")])
    >>> [b.content for b in response.message.blocks if isinstance(b, ThinkingBlock)], response.message.content
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
    keep_alive: float | str | None = Field(default=None, description="Idle seconds (or '5m') before the shared "
                                           "engine sleeps; the next call wakes it. None: the engine's setting.")
    lora: Any = Field(default=None, description="LoRA adapter: a known name, a PEFT dir or a LoRARequest; None: base.")
    speculative: dict[str, Any] | None = Field(default=None, description="Speculative decoding, as LLM(speculative=)"
                                               ", e.g. {'method': 'ngram', 'num_speculative_tokens': 4}; None: off.")
    thinking: bool | None = Field(default=None, description="Thinking models: on, off, or None for the default.")
    max_reasoning_tokens: int | None = Field(default=None, description="Thinking budget; then the model answers.")
    reasoning_parser: str | None = Field(default=None, description="Think-block format; None: from the template.")

    @classmethod
    def class_name(cls) -> str:
        return "HearthLLM"

    @property
    def core(self) -> EngineCore:
        """The shared engine; the same object ChatHearth gets for this model and config."""
        keep_alive = {} if self.keep_alive is None else {"keep_alive": self.keep_alive}
        speculative = {} if self.speculative is None else {"speculative": self.speculative}
        return get_engine(self.model, **{"show_progress": False, **self.engine_kwargs, **keep_alive, **speculative})

    @property
    def metadata(self) -> LLMMetadata:
        """Reads the context window from the engine, so the first access loads the model."""
        return LLMMetadata(context_window=self.context_window or self.core.model_info.max_model_len,
                           num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS, is_chat_model=True,
                           is_function_calling_model=True, model_name=self.model)

    # ---- chat ---------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await self._achat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return self._astream_chat(messages, kwargs)

    # ---- complete: chat on one user turn (or on the raw prompt), converted by llama-index -----

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_response_to_completion_response(self._chat(_chat_input(prompt, formatted), kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_response_to_completion_response(await self._achat(_chat_input(prompt, formatted), kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return stream_chat_response_to_completion_response(self._stream_chat(_chat_input(prompt, formatted), kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        return astream_chat_response_to_completion_response(
            self._astream_chat(_chat_input(prompt, formatted), kwargs))

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
            if (response.raw or {}).get("finish_reason") == "length":  # a call cut short is no call
                num_tokens = response.raw.get("usage", {}).get("completion_tokens")
                raise ValueError(f"the tool call was cut after {num_tokens} tokens by max_tokens (or the end of the "
                                 f"context) before it was complete (finish_reason='length'); raise max_tokens or "
                                 f"leave it None")
            raise ValueError(f"expected at least one tool call in the response, got none: "
                             f"{response.message.content!r}")
        return calls

    # ---- mapping ------------------------------------------------------------------------------

    def _chat(self, messages: Sequence[ChatMessage] | str, kwargs: dict[str, Any]) -> ChatResponse:
        request = self._request(messages, kwargs)
        return _chat_response(self._service().stream(request).collect(), self.model, _lora_name(request))

    async def _achat(self, messages: Sequence[ChatMessage] | str, kwargs: dict[str, Any]) -> ChatResponse:
        request = self._request(messages, kwargs)
        return _chat_response(await (await self._service().astream(request)).acollect(), self.model,
                              _lora_name(request))

    def _stream_chat(self, messages: Sequence[ChatMessage] | str, kwargs: dict[str, Any]) -> ChatResponseGen:
        request = self._request(messages, kwargs)  # bad options raise now; the request is queued on first next()

        def chunks() -> Iterator[ChatResponse]:
            content, thinking = "", ""
            with self._service().stream(request) as stream:  # leaving early aborts the request at once
                for delta in stream:
                    content, thinking = content + delta.content, thinking + delta.reasoning
                    yield _chat_chunk(delta, content, thinking, self.model, _lora_name(request))
        return chunks()

    def _astream_chat(self, messages: Sequence[ChatMessage] | str, kwargs: dict[str, Any]) -> ChatResponseAsyncGen:
        request = self._request(messages, kwargs)

        async def chunks() -> AsyncIterator[ChatResponse]:
            content, thinking = "", ""
            with await self._service().astream(request) as stream:
                async for delta in stream:
                    content, thinking = content + delta.content, thinking + delta.reasoning
                    yield _chat_chunk(delta, content, thinking, self.model, _lora_name(request))
        return chunks()

    def _service(self) -> ChatService:
        return ChatService(self.core)

    def _request(self, messages: Sequence[ChatMessage] | str, kwargs: dict[str, Any]) -> ChatRequest:
        kwargs = dict(kwargs)
        tools, tool_choice = kwargs.pop("tools", None) or None, kwargs.pop("tool_choice", None)
        lora = kwargs.pop("lora", self.lora)
        thinking = kwargs.pop("thinking", self.thinking)
        max_reasoning_tokens = kwargs.pop("max_reasoning_tokens", self.max_reasoning_tokens)
        unknown = sorted(set(kwargs) - set(_SAMPLING_OPTIONS))
        if unknown:
            known = ["tools", "tool_choice", "lora", "thinking", "max_reasoning_tokens", *_SAMPLING_OPTIONS]
            raise TypeError(f"HearthLLM got unknown call option(s) {unknown}; known: {known}")
        options = {name: kwargs.get(name, getattr(self, name)) for name in _SAMPLING_OPTIONS}
        return ChatRequest(messages if isinstance(messages, str) else to_chat_messages(messages), tools=tools,
                           tool_choice=tool_choice, sampling=SamplingOptions(**options),
                           tool_parser=self.tool_parser, timeout=self.timeout, lora_request=lora,
                           reasoning=thinking, max_reasoning_tokens=max_reasoning_tokens,
                           reasoning_parser=self.reasoning_parser)


def _chat_input(prompt: str, formatted: bool) -> list[ChatMessage] | str:
    """What ``complete`` sends: the prompt as one user turn of the chat template, or as is."""
    return prompt if formatted else [ChatMessage(role=MessageRole.USER, content=prompt)]


def _lora_name(request: ChatRequest) -> str | None:
    return None if request.lora_request is None else request.lora_request.name


def _chat_response(result: HearthChatResult, model_name: str, lora_name: str | None = None) -> ChatResponse:
    return ChatResponse(message=_message(result), raw=_raw(result, model_name, lora_name),
                        additional_kwargs=_usage_kwargs(result))


def _chat_chunk(delta: ChatDelta, content: str, thinking: str, model_name: str,
                lora_name: str | None = None) -> ChatResponse:
    """A streamed response: ``delta`` is the new user-facing text, ``message`` all of it so far (the
    thinking so far as a ``ThinkingBlock``, its new text in ``additional_kwargs["thinking_delta"]``);
    tool calls (their markup held out of the text) arrive whole on the last chunk."""
    thinking_delta = {"thinking_delta": delta.reasoning} if delta.reasoning else {}
    if delta.result is None:
        blocks = ([ThinkingBlock(content=thinking)] if thinking else []) + [TextBlock(text=content)]
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks), delta=delta.content,
                            additional_kwargs=thinking_delta)
    response = _chat_response(delta.result, model_name, lora_name)
    response.delta = delta.content
    response.additional_kwargs.update(thinking_delta)
    return response


def _message(result: HearthChatResult) -> ChatMessage:
    thinking = [ThinkingBlock(content=result.reasoning, num_tokens=getattr(result.usage, "reasoning_tokens", None))
                ] if result.reasoning else []
    blocks = thinking + [TextBlock(text=result.content)]
    blocks += [ToolCallBlock(tool_call_id=call.id, tool_name=call.name, tool_kwargs=call.arguments)
               for call in result.tool_calls]
    extra = {"invalid_tool_calls": [{"id": bad.id, "name": bad.name, "raw": bad.raw_arguments, "error": bad.error}
                                    for bad in result.invalid_tool_calls]} if result.invalid_tool_calls else {}
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)


def _raw(result: HearthChatResult, model_name: str, lora_name: str | None = None) -> dict[str, Any]:
    raw = {"model": model_name, "finish_reason": result.finish_reason, "stop_reason": result.stop_reason,
           "usage": _usage_kwargs(result)}
    if lora_name is not None:
        raw["lora_name"] = lora_name  # the adapter that answered
    return raw


def _usage_kwargs(result: HearthChatResult) -> dict[str, int]:
    usage = result.usage
    if usage is None:
        return {}
    counts = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
              "total_tokens": usage.total_tokens, "cached_tokens": usage.cached_tokens}
    if getattr(usage, "reasoning_tokens", 0):  # a ChatUsage, for a model with a reasoning format
        counts["reasoning_tokens"] = usage.reasoning_tokens
    return counts


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
