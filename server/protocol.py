"""The request bodies the server accepts: OpenAI's fields, typed strictly, unknown fields refused.

Every model forbids fields it does not name, so a field that would change the answer and that
we cannot honour never passes silently; the few OpenAI fields that change nothing here are named
below with why. Range checks of sampling values are the engine's (``SamplingParams`` raises
``ValueError`` naming the field); types and shapes are checked here.

>>> ChatCompletionRequest.model_validate({"model": "default", "messages": [{"role": "user", "content": "Hi"}]})

Accepted and without effect (each is about OpenAI's service, not about the answer):
``user`` and ``safety_identifier`` (logged with the request id), ``metadata``, ``store`` (only
``false``: nothing is stored), ``service_tier`` (one tier), ``prompt_cache_key`` (prefix caching
is automatic), ``stream_options.include_obfuscation`` (no padding is ever added), ``modalities``
(only ``["text"]``), ``response_format``'s ``json_schema.strict`` (the schema is always enforced),
``json_schema.name`` and ``.description`` (labels), ``tools[].function.strict`` false.

Honoured beyond the obvious: ``parallel_tool_calls=false`` keeps the first call only;
``tools[].function.strict=true`` only with a forced ``tool_choice`` (else 400); ``developer``
messages are ``system`` messages. vLLM's extensions accepted: ``top_k``, ``repetition_penalty``,
``priority`` (lower runs first), ``chat_template_kwargs``; for completions also ``min_p``,
``min_tokens``, ``ignore_eos``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from hearth_llm.engine.sampling_params import MAX_LOGPROBS

# Fields OpenAI has that we refuse by name, with what to do instead (any other unknown field is refused too).
REFUSED_FIELDS = {
    "functions": "the deprecated functions API is not supported; send tools",
    "function_call": "the deprecated functions API is not supported; send tool_choice",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning effort is not supported by this server",
    "verbosity": "verbosity is not supported by this server",
    "best_of": "best_of is not supported; send n",
}


def _prompt_kind(value: Any) -> str:
    """Which member of :data:`Prompt` a value is, from its first item: a list of 1000 token ids is
    then checked once as ``list[int]`` (~9 us), not against every member as a plain union is
    (~77 us, most of it the errors of ``list[str]``). The tags are pydantic's own member names, so
    an error's location reads as before (``prompt[3]``)."""
    if not isinstance(value, list):
        return "str"  # a string, or what should have been one
    if value and isinstance(value[0], str):
        return "list[str]"
    if value and isinstance(value[0], list):
        return "list[list[int]]"
    return "list[int]"


# A string, strings, token ids or lists of token ids (completions' prompt, embeddings' input).
Prompt = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[str], Tag("list[str]")],
                         Annotated[list[int], Tag("list[int]")], Annotated[list[list[int]], Tag("list[list[int]]")]],
                   Discriminator(_prompt_kind)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _OpenAIServiceFields(_Body):
    """Fields about OpenAI's service that change nothing in the answer (see the module docstring)."""

    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: str | None = None


class _SamplingFields(_Body):
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None
    repetition_penalty: float | None = None
    priority: int | None = None


class ChatCompletionRequest(_OpenAIServiceFields, _SamplingFields):
    """``POST /v1/chat/completions``. ``messages`` are checked by the chat service (roles, text parts)."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text"]] | None = None
    # vLLM's extension
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_OpenAIServiceFields, _SamplingFields):
    """``POST /v1/completions``: a string, strings, token ids or lists of token ids."""

    model: str
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    # vLLM's extensions
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``."""

    model: str
    input: Prompt
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class TokenizeRequest(_Body):
    """``POST /tokenize``: a ``prompt`` as the completions endpoint reads it, or ``messages`` as
    the chat endpoint renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]
