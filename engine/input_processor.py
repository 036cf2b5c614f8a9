"""Admission: every request is checked once, tokenized once and fanned out into its ``n`` samples.

Two halves, split by what they need:

- :func:`request_input` runs on the caller's thread and needs no model: sampling parameters,
  priority and request id. A bad argument raises there, before anything is queued.
- :class:`InputProcessor` runs on the engine thread, where the tokenizer lives: it renders a
  :class:`ChatPrompt`, tokenizes, checks the token ids against the vocabulary and the context,
  and builds one :class:`Request` per sample. It changes no engine state, so a batch whose
  last prompt is bad leaves no trace of its first ones (:meth:`InputProcessor.process`).

Chat templates render here and nowhere else: callers (``LLM.chat``, the chat service) send a
``ChatPrompt`` and never render it themselves. Why here:

- one place: the text that is tokenized is the text that was rendered, with the tokenizer the
  engine really runs, and a template fix lands once;
- the caller never waits for the model load: a caller has no tokenizer until the model has
  loaded, and rendering on the engine thread lets ``add_request`` return a stream at once;
- a template that rejects a conversation fails that request's stream with a ``ValueError``,
  exactly like any other bad prompt (empty, too long, unknown token ids);
- a batch is admitted atomically: a conversation that does not render rejects its whole batch
  before any of it is queued, as a bad token id does.

>>> processor = InputProcessor(tokenizer, vocab_size=320, max_model_len=96, eos_token_ids=frozenset({2}))
>>> [children] = processor.process([request_input([5, 6, 7], SamplingParams(n=2))], ids_in_use={})
>>> [child.request_id for child in children]
['3f2a...#0', '3f2a...#1']
"""
from __future__ import annotations

import itertools
import uuid
from collections.abc import Container
from dataclasses import dataclass

from .chat.prompt import ChatPrompt, render_chat_prompt
from .lora.request import LoRARequest
from .request import Request
from .sampling_params import SamplingParams

Prompt = str | list[int] | ChatPrompt


@dataclass(slots=True)
class RequestInput:
    """One request as a caller asked for it, its model-free arguments already checked."""

    request_id: str
    prompt: Prompt
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


def request_input(prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                  priority: int = 0, cache_salt: str | None = None,
                  lora_request: LoRARequest | None = None) -> RequestInput:
    """Check what can be checked without the model; raises ``TypeError``/``ValueError`` naming the argument.

    >>> request_input("Hi", SamplingParams(temperature=-1))
    Traceback (most recent call last):
    ValueError: temperature must be in [0.0, 2.0], got -1
    """
    params = sampling_params if sampling_params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
    request_id = uuid.uuid4().hex if request_id is None else str(request_id)
    return RequestInput(request_id, prompt, params, priority, cache_salt, lora_request)


class BatchRejectedError(Exception):
    """Request ``index`` of a batch is invalid (``error``), so none of the batch was queued."""

    def __init__(self, index: int, error: Exception):
        super().__init__(f"prompt {index} of this batch is invalid, so none was queued: {error}")
        self.index = index
        self.error = error

    def error_for(self, index: int) -> Exception:
        """What request ``index`` of the batch raises: the error itself, or a ValueError naming it."""
        if index == self.index:
            return self.error
        copy = ValueError(str(self))
        copy.__cause__ = self.error
        return copy


class InputProcessor:
    """Turns checked :class:`RequestInput` into queued-to-be :class:`Request` objects (one per sample)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 enable_prefix_caching: bool = True, lora_manager=None) -> None:
        self.tokenizer = tokenizer
        self.lora_manager = lora_manager  # an engine.lora.LoRAManager when LoRA is enabled
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.enable_prefix_caching = enable_prefix_caching
        self._arrival_counter = itertools.count()

    def process(self, inputs: list[RequestInput], ids_in_use: Container[str]) -> list[list[Request]]:
        """Each input's samples, or :class:`BatchRejectedError` for the first invalid one; changes nothing."""
        prepared, batch_ids = [], set()
        for index, request in enumerate(inputs):
            try:
                if request.request_id in batch_ids:
                    _raise_in_use(request.request_id)
                prepared.append(self._tokenize(request, ids_in_use))
            except Exception as error:  # any failure of one prompt rejects its batch
                raise BatchRejectedError(index, error) from error
            batch_ids.add(request.request_id)
        return [self._fan_out(request, *checked) for request, checked in zip(inputs, prepared)]

    def process_one(self, request: RequestInput, ids_in_use: Container[str]) -> list[Request]:
        """One input's samples; raises its error as it is (``ValueError`` naming what is wrong)."""
        return self._fan_out(request, *self._tokenize(request, ids_in_use))

    def _tokenize(self, request: RequestInput, ids_in_use: Container[str]) -> tuple[str | None, list[int], object]:
        if request.request_id in ids_in_use:
            _raise_in_use(request.request_id)
        text, token_ids = self._token_ids(request.prompt)
        self._check_token_ids(token_ids)
        self._check_max_tokens(token_ids, request.sampling_params)
        return text, token_ids, self._lora_adapter(request.lora_request)

    def _lora_adapter(self, lora_request: LoRARequest | None):
        """The loaded, checked adapter (``ValueError`` naming it if unknown or bad), or None."""
        if lora_request is None:
            return None
        if self.lora_manager is None:
            raise ValueError(f"lora_request {lora_request.name!r}: LoRA is off; start the engine with enable_lora=True")
        return self.lora_manager.resolve(lora_request)

    def _token_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, ChatPrompt):
            prompt = render_chat_prompt(self.tokenizer, prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and _are_token_ids(prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")

    def _check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        # min/max first: one pass in C (a burst of long prompts spent most of its host time here)
        bad = [] if 0 <= min(token_ids) and max(token_ids) < self.vocab_size else \
            [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; it must be shorter than max_model_len={self.max_model_len}")

    def _check_max_tokens(self, token_ids: list[int], params: SamplingParams) -> None:
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} does not fit: the prompt has {len(token_ids)} tokens and "
                f"max_model_len={self.max_model_len} leaves room for at most {room}; lower max_tokens or pass None")

    def _fan_out(self, request: RequestInput, text: str | None, token_ids: list[int], lora=None) -> list[Request]:
        """One Request per sample; siblings wait for the first sample's prompt to be cached, then
        reuse its blocks through the prefix cache."""
        if lora is not None:
            self.lora_manager.remember(lora)  # the whole batch passed its checks: its adapters are known now
        n = request.sampling_params.n
        children = []
        for index in range(n):
            child = Request(
                request_id=request.request_id if n == 1 else f"{request.request_id}#{index}",
                prompt_token_ids=token_ids, sampling_params=request.sampling_params,
                eos_token_ids=self.eos_token_ids, priority=request.priority, prompt=text,
                group_id=request.request_id, sample_index=index, cache_salt=request.cache_salt, lora=lora,
                arrival_order=next(self._arrival_counter),
            )
            if index > 0 and self.enable_prefix_caching:
                child.waits_for = children[0]
            children.append(child)
        return children


def _are_token_ids(prompt) -> bool:
    """Every item an int (not a bool): the types in one pass in C when all are exactly int (a 2k-token
    prompt took ~0.5 ms in the item-by-item check); anything else gets the exact check."""
    return set(map(type, prompt)) <= {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def _raise_in_use(request_id: str) -> None:
    raise ValueError(f"request_id {request_id!r} is already in use")
