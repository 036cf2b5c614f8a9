"""What a caller asks of the chat service: a conversation, the tools on offer, how to sample.

Every field but ``messages`` is keyword-only with a default, so later options (reasoning, a LoRA
adapter) are new fields that no existing caller has to pass.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

from ..lora.request import LoRARequest, as_lora_request
from ..sampling_params import SamplingParams
from ..reasoning import get_reasoning_parser
from ..structured_output import StructuredOutput
from ..tool_parsers import get_tool_parser

# The SamplingParams fields a chat request may set; None leaves the engine's default.
_PASSED_THROUGH = ("n", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


@dataclass(slots=True)
class SamplingOptions:
    """How to sample a chat answer; None means the engine's default.

    Unlike :class:`SamplingParams`, ``max_tokens=None`` generates until EOS, a stop string or the
    end of the context, and log-probabilities are asked for the OpenAI way (``logprobs=True``,
    ``top_logprobs=N``). ``n`` answers are sampled from one prompt (its KV blocks shared); their
    deltas carry ``ChatDelta.index`` and ``ChatStream.results`` holds one result each.

    >>> SamplingOptions(temperature=0, max_tokens=64, stop=["\\n\\n"]).to_sampling_params().max_tokens
    64
    """

    temperature: float | None = None
    max_tokens: int | None = None
    n: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: list[str] | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def to_sampling_params(self, structured_output: StructuredOutput | dict | None = None) -> SamplingParams:
        """The engine's parameters; invalid values raise ``ValueError`` naming the field."""
        values = {name: getattr(self, name) for name in _PASSED_THROUGH if getattr(self, name) is not None}
        if self.logprobs or self.top_logprobs:
            values["logprobs"] = self.top_logprobs or 0
        return SamplingParams(**values, max_tokens=self.max_tokens, stop=self.stop or None,
                              structured_output=structured_output)


@dataclass(slots=True)
class ChatRequest:
    """One chat turn to generate.

    >>> ChatRequest([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
    ...             tool_choice="required", sampling=SamplingOptions(temperature=0))

    ``messages``: ``{"role", "content", ...}`` dicts (OpenAI's form; assistant ``tool_calls`` and
    tool results included), or a string that is already formatted for the model, sent without the
    chat template. ``tools``: OpenAI-style function tools. ``tool_choice``: ``"auto"`` (default),
    ``"none"`` (tools are not offered), ``"required"``/``"any"``/True (a call, forced by grammar) or
    a tool's name / ``{"type": "function", "function": {"name": ...}}``. ``structured_output``:
    the answer's grammar (a :class:`StructuredOutput` or its fields as a dict); not with a forced
    ``tool_choice``. ``tool_parser``: the tool-call format; None reads it from the chat template.
    ``timeout``: seconds; past it the request is aborted and the stream raises ``TimeoutError``.
    ``priority``: the scheduler's priority (lower runs first; default 0). ``request_id``: the
    engine's id for the request (default a fresh one), e.g. an HTTP request id to find it in logs.

    Thinking models: ``reasoning`` True/False turns thinking on/off through the template's switch
    (Qwen3's ``enable_thinking``); None keeps the model's default. Either way the think block is
    split from the answer (``ChatResult.reasoning``) when the model has a reasoning format
    (``reasoning_parser``, None: read from the chat template). ``max_reasoning_tokens``: a budget
    after which the think block is closed and the model answers. A grammar (``structured_output``
    or a forced ``tool_choice``) constrains only the answer, after the think block.

    ``lora_request``: the LoRA adapter to answer with (a :class:`LoRARequest`, an adapter name the
    engine knows or a PEFT directory; the engine needs ``enable_lora=True``); None: the base model.
    """

    messages: list[dict] | str
    _: KW_ONLY
    tools: list[dict] | None = None
    tool_choice: str | dict | bool | None = None
    structured_output: StructuredOutput | dict | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    tool_parser: str | None = None
    chat_template_kwargs: dict | None = None
    timeout: float | None = None
    priority: int = 0
    request_id: str | None = None
    reasoning: bool | None = None
    reasoning_parser: str | None = None
    max_reasoning_tokens: int | None = None
    lora_request: LoRARequest | str | None = None

    def __post_init__(self) -> None:
        self.lora_request = as_lora_request(self.lora_request)  # ValueError naming lora for other types
        if isinstance(self.messages, str) and (self.tools or self.chat_template_kwargs):
            raise ValueError("messages: a preformatted prompt (a str) takes no tools or chat_template_kwargs; "
                             "send the conversation as message dicts")
        if not isinstance(self.sampling, SamplingOptions):
            raise ValueError(f"sampling must be a SamplingOptions, got {type(self.sampling).__name__}")
        if self.tool_parser is not None:
            get_tool_parser(self.tool_parser)  # ValueError naming tool_parser and the known formats
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.reasoning is not None and not isinstance(self.reasoning, bool):
            raise ValueError(f"reasoning must be True, False or None, got {self.reasoning!r}")
        if self.max_reasoning_tokens is not None:
            if isinstance(self.max_reasoning_tokens, bool) or not isinstance(self.max_reasoning_tokens, int) \
                    or self.max_reasoning_tokens < 1:
                raise ValueError(f"max_reasoning_tokens must be an int >= 1 or None, got {self.max_reasoning_tokens!r}")
            if self.reasoning is False:
                raise ValueError("max_reasoning_tokens is a budget for thinking; it cannot be set with reasoning=False")

    @property
    def is_preformatted(self) -> bool:
        return isinstance(self.messages, str)
