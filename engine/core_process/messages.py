"""What the parent and the child-process engine core say to each other over their pipe.

Parent → child: :class:`AddRequests`, :class:`Abort`, :class:`Call`, :class:`Close`. Child →
parent: :class:`Started` (loaded, or the load's error), one :class:`Outputs` per engine step (an
:class:`Output` per item handed out between steps), a :class:`Reply` per call, and
:class:`Stopped` when its engine stops. Every message is a small picklable dataclass; token
outputs are the engine's own ``StreamOutput`` objects.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model_info import ModelInfo
from ..outputs import StreamOutput


# ---- parent → child ------------------------------------------------------------------------


@dataclass(slots=True)
class AddRequests:
    """``EngineCore.add_requests``' arguments, checked in the parent (ids fixed there);
    ``stream_ids`` name the parent's streams, one per prompt. Answered with a :class:`Reply`."""

    call_id: int
    stream_ids: list[int]
    prompts: list
    sampling_params: list
    request_ids: list[str]
    priorities: list[int]
    cache_salt: str | None
    lora_requests: list


@dataclass(slots=True)
class Abort:
    """Abort a request by its id (``LLM.abort``), or the request of the parent's stream
    ``stream_id`` (its reader stopped early) if that stream still owns it."""

    request_id: str | None = None
    stream_id: int | None = None


@dataclass(slots=True)
class Call:
    """Run ``EngineCore.<method>(*args)`` in the child and answer with a :class:`Reply`."""

    call_id: int
    method: str
    args: tuple = ()


@dataclass(slots=True)
class Close:
    pass


# ---- child → parent ------------------------------------------------------------------------


@dataclass(slots=True)
class EngineView:
    """What the parent may read of the child's loaded engine (``LLM.engine`` in process mode).

    >>> LLM("default", engine_core="process").engine.max_model_len
    8192
    """

    tokenizer: object
    hf_config: object
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    dtype: object          # torch.dtype the weights compute in
    pid: int               # the child process
    lora_manager: None = None  # LoRA needs engine_core="thread"


@dataclass(slots=True)
class Started:
    """The child's engine has loaded (its view, model facts and first counters), or failed to (``error``)."""

    view: EngineView | None = None
    model_info: ModelInfo | None = None
    stats: dict | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class Output:
    stream_id: int
    item: object           # a StreamOutput, or the exception the stream raises


@dataclass(slots=True)
class Outputs:
    """One engine step's outputs for every stream, as one message: ``(stream_id, item)`` pairs in
    the order the core handed them out (one pickle and one pipe write per step, not per token).
    A plain token output travels as ``(stream_id, delta_text, delta_token_ids, index)``
    (:func:`compact`): ~0.1 us to pickle instead of ~3.5 us for the dataclass."""

    items: list[tuple]


def compact(stream_id: int, item) -> tuple:
    """``(stream_id, item)``, or for an output that only carries tokens (not the last, no
    finish, no logprobs) the 4-tuple :func:`expanded` turns back into it."""
    if (type(item) is StreamOutput and item.finish_reason is None and not item.finished
            and item.logprobs is None and item.stop_reason is None):
        return stream_id, item.delta_text, item.delta_token_ids, item.index
    return stream_id, item


def expanded(request_id: str, entry: tuple):
    """The item of an :class:`Outputs` entry; ``request_id`` names the stream's request."""
    if len(entry) == 2:
        return entry[1]
    _, delta_text, delta_token_ids, index = entry
    return StreamOutput(request_id, delta_text, delta_token_ids, index)


@dataclass(slots=True)
class Reply:
    call_id: int
    value: object = None
    error: BaseException | None = None


@dataclass(slots=True)
class Stopped:
    error: BaseException  # EngineClosedError, or the EngineDeadError the loop died with
