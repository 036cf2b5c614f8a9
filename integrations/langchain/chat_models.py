"""``ChatHearth``: a LangChain chat model served by the in-process hearth engine."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

try:
    from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
except ImportError as error:  # the optional extra is missing
    raise ImportError("ChatHearth needs langchain-core: pip install 'hearth-llm[langchain]'") from error
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage, HumanMessage,
                                     SystemMessage, ToolMessage)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import get_config_list
from pydantic import Field

from hearth_llm.engine import (ChatPrompt, EngineCore, RequestStream, SamplingParams, StreamOutput, Usage,
                               get_engine)

PROVIDER = "hearth"
# max_tokens=None: generate until a stop, EOS or the end of the context (the engine enforces that).
_NO_TOKEN_LIMIT = 1 << 30
# Per-call keyword arguments (``invoke(..., temperature=0)``) that map to sampling parameters.
_SAMPLING_OPTIONS = ("temperature", "max_tokens", "top_p", "top_k", "seed", "logprobs", "top_logprobs",
                     "presence_penalty", "frequency_penalty", "stop")
# Content blocks that carry no text for the model to read again.
_SKIPPED_BLOCK_TYPES = frozenset({"tool_call", "tool_call_chunk", "invalid_tool_call", "reasoning", "thinking"})


class ChatHearth(BaseChatModel):
    """Chat with a local model through the hearth engine, in this process: no server, no API key.

    Setup:
        .. code-block:: bash

            pip install "hearth-llm[langchain]"

    Key init args:
        model: ``"default"`` (SmolLM2-135M-Instruct, bundled), a HF directory, a ``.gguf`` file or a hub id.
        temperature, max_tokens, top_p, top_k, stop, seed, presence_penalty, frequency_penalty:
            sampling; ``max_tokens=None`` generates until EOS, a stop string or the context's end.
        logprobs, top_logprobs: return token log-probabilities in ``response_metadata["logprobs"]``.
        timeout: seconds per request; past it the request is aborted and ``TimeoutError`` raised.
        engine_kwargs: :class:`EngineConfig` fields (``max_num_seqs``, ``kv_cache_memory``, ...).
            Every ChatHearth, ``AsyncLLM`` and ``LLM`` on the same model and config shares one
            engine, its KV cache and its prefix cache.

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

    Tool calling and structured output are not offered yet; earlier tool calls and tool results
    in the history (``AIMessage.tool_calls``, ``ToolMessage``) are rendered for the model.
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
    timeout: float | None = None
    streaming: bool = False
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)

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

    # ---- the four native paths ---------------------------------------------------------------

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._prepare(messages, stop, kwargs)
        outputs = []
        with call.submit() as stream:
            for output in stream:
                outputs.append(output)
                if run_manager is not None and run_manager.handlers and output.delta_text:
                    run_manager.on_llm_new_token(output.delta_text, chunk=call.chunk(output))
        return call.result(outputs)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._prepare(messages, stop, kwargs)
        outputs = []
        with call.submit() as stream:
            async for output in stream:
                outputs.append(output)
                if run_manager is not None and run_manager.handlers and output.delta_text:
                    await run_manager.on_llm_new_token(output.delta_text, chunk=call.chunk(output))
        return call.result(outputs)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, kwargs)
        with call.submit() as stream:  # leaving early aborts the request at once
            for output in stream:
                chunk = call.chunk(output)
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, kwargs)
        with call.submit() as stream:
            async for output in stream:
                chunk = call.chunk(output)
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
        unknown = sorted(set(kwargs) - set(_SAMPLING_OPTIONS))
        if unknown:
            raise TypeError(f"ChatHearth got unknown call option(s) {unknown}; known: {['model', *_SAMPLING_OPTIONS]}")
        options = self._options(stop, kwargs)
        core = get_engine(model, **{"show_progress": False, **self.engine_kwargs})
        prompt = ChatPrompt(to_chat_messages(messages))
        return _Call(core, prompt, _sampling_params(options), model, options["top_logprobs"] or 0, self.timeout)


@dataclass(slots=True)
class _Call:
    """One request: what to send to the engine, and how to turn its outputs into LangChain's types."""

    core: EngineCore
    prompt: ChatPrompt
    params: SamplingParams
    model_name: str
    num_top_logprobs: int
    timeout: float | None

    def submit(self) -> RequestStream:
        return self.core.add_request(self.prompt, self.params, timeout=self.timeout)

    def chunk(self, output: StreamOutput) -> ChatGenerationChunk:
        metadata = self._logprobs_metadata([output])
        if not output.finished:
            return ChatGenerationChunk(message=AIMessageChunk(content=output.delta_text, response_metadata=metadata))
        message = AIMessageChunk(content=output.delta_text, usage_metadata=_usage_metadata(output.usage),
                                 response_metadata={**metadata, **self._final_metadata(output)},
                                 chunk_position="last")
        return ChatGenerationChunk(message=message)

    def result(self, outputs: list[StreamOutput]) -> ChatResult:
        last = outputs[-1]
        message = AIMessage(content="".join(output.delta_text for output in outputs),
                            usage_metadata=_usage_metadata(last.usage),
                            response_metadata={**self._logprobs_metadata(outputs), **self._final_metadata(last)})
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _final_metadata(self, last: StreamOutput) -> dict[str, Any]:
        return {"model_name": self.model_name, "model_provider": PROVIDER, "finish_reason": last.finish_reason,
                "stop_reason": last.stop_reason}

    def _logprobs_metadata(self, outputs: list[StreamOutput]) -> dict[str, Any]:
        if self.params.logprobs is None:
            return {}
        content = []
        for output in outputs:
            for token_id, entries in zip(output.delta_token_ids, output.logprobs or []):
                content.append(_token_logprob(token_id, entries, self.num_top_logprobs))
        return {"logprobs": {"content": content}}


def _sampling_params(options: dict[str, Any]) -> SamplingParams:
    values = {name: options[name] for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty",
                                               "frequency_penalty") if options[name] is not None}
    values["max_tokens"] = options["max_tokens"] if options["max_tokens"] is not None else _NO_TOKEN_LIMIT
    values["stop"] = list(options["stop"]) if options["stop"] else None
    if options["logprobs"] or options["top_logprobs"]:
        values["logprobs"] = options["top_logprobs"] or 0
    return SamplingParams(**values)


def _usage_metadata(usage: Usage | None) -> UsageMetadata | None:
    if usage is None:
        return None
    return UsageMetadata(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens, input_token_details={"cache_read": usage.cached_tokens})


def _token_logprob(token_id: int, entries: dict, num_top: int) -> dict[str, Any]:
    chosen = entries[token_id]
    top = sorted((entry for entry in entries.values() if entry.rank <= num_top), key=lambda entry: entry.rank)
    return {"token": chosen.decoded_token, "bytes": list((chosen.decoded_token or "").encode()),
            "logprob": chosen.logprob,
            "top_logprobs": [{"token": e.decoded_token, "bytes": list((e.decoded_token or "").encode()),
                              "logprob": e.logprob} for e in top]}


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
