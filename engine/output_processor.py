"""After sampling: accept each new token (grammar, stop checks, detokenizing, logprob dicts), record
prompt logprobs, and turn what a step changed into :class:`RequestDelta` and :class:`StreamOutput`.

It decides *whether* a request is finished and why; the engine tells the scheduler, which frees
the blocks. It owns one incremental detokenizer per sequence.

>>> processor = OutputProcessor(tokenizer, max_model_len=96)
>>> processor.add_request(request)
>>> delta, finish = processor.accept_token(request, token_id, logprobs=None)
>>> delta.new_text, finish          # finish: ("stop" | "length", stop_reason) or None
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .detokenizer import IncrementalDetokenizer
from .outputs import Logprob, StreamOutput, Usage
from .request import Request
from .structured_output import GrammarError

Finish = tuple[str, "str | int | None"]  # (finish_reason, stop_reason)


@dataclass(slots=True)
class RequestDelta:
    """What one step changed for one sequence."""

    request: Request
    new_token_ids: list[int]
    new_text: str
    is_finished: bool
    error: BaseException | None = None


class OutputProcessor:
    """Accepts sampled tokens into their requests and says when a request has finished."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_generation_tokens = 0

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, params.stop_strings, params.skip_special_tokens, params.include_stop_str_in_output)

    def forget(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)

    def accept_token(self, request: Request, token_id: int, logprobs) -> tuple[RequestDelta, Finish | None]:
        """Append one sampled token; the delta to stream and, when the request is done, why.

        Raises :class:`GrammarError` for a token the request's grammar refuses (a sampler bug)."""
        request.append_token(token_id)
        self.num_generation_tokens += 1
        if request.matcher is not None and not request.matcher.accept_token(token_id):
            raise GrammarError(f"token {token_id} was sampled outside the request's grammar")
        params = request.sampling_params
        detokenizer = self.detokenizers[request.request_id]
        past_min_tokens = request.num_output_tokens >= params.min_tokens
        stop_string = detokenizer.add_token(token_id, check_stop=past_min_tokens) if params.detokenize else None
        if logprobs is not None:
            request.logprobs.append(self.to_logprobs(logprobs))
        finish = self._finish(request, token_id, stop_string, past_min_tokens)
        request.output_text = detokenizer.text
        is_finished = finish is not None
        return RequestDelta(request, [token_id], detokenizer.take_stream_delta(is_finished), is_finished), finish

    def accept_tokens(self, request: Request, token_ids: list[int], logprobs: list) -> tuple[RequestDelta, Finish | None]:
        """Append a verification step's accepted run token by token, each checked as if it came
        alone: the run ends at the first token that finishes the request (EOS, a stop token or
        string, ``max_tokens``, the context's end) and the tokens after it are dropped.

        >>> delta, finish = processor.accept_tokens(request, [7, 8, 2, 9], [None] * 4)   # 2 is EOS
        >>> delta.new_token_ids, finish
        ([7, 8, 2], ('stop', None))
        """
        new_token_ids, texts, finish = [], [], None
        for token_id, token_logprobs in zip(token_ids, logprobs):
            delta, finish = self.accept_token(request, token_id, token_logprobs)
            new_token_ids.append(token_id)
            texts.append(delta.new_text)
            if finish is not None:
                break
        return RequestDelta(request, new_token_ids, "".join(texts), finish is not None), finish

    def _finish(self, request: Request, token_id: int, stop_string: str | None, past_min_tokens: bool) -> Finish | None:
        params = request.sampling_params
        if stop_string is not None:
            return "stop", stop_string
        if request.matcher is not None and request.matcher.is_terminated():
            return "stop", None
        if past_min_tokens:
            if token_id in params.stop_token_ids:
                return "stop", token_id
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return "stop", None
        if request.is_at_length_limit(self.max_model_len):
            return "length", None
        return None

    def to_logprobs(self, entries: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        """``{token: (logprob, rank)}`` as :class:`Logprob` entries with each token's text."""
        return {token: Logprob(value, rank, self.tokenizer.decode([token])) for token, (value, rank) in entries.items()}

    def record_prompt_logprobs(self, requests: list[Request], prompt_logits: dict[int, torch.Tensor]) -> None:
        """Append the logprobs of the prompt tokens a step just computed (``prompt_logits`` maps a
        batch index to the logits of that request's chunk; its ``num_computed_tokens`` is already
        past the chunk)."""
        for index, logits in prompt_logits.items():
            request = requests[index]
            if not request.prompt_logprobs:
                request.prompt_logprobs.append(None)  # the first prompt token has no context
            start = request.num_computed_tokens - logits.shape[0]
            logprobs = torch.log_softmax(logits, dim=-1)
            for offset in range(logits.shape[0]):
                target = start + offset + 1
                if target >= request.num_prompt_tokens:
                    break
                top = _top_and_actual(logprobs[offset], request.prompt_token_ids[target],
                                      request.sampling_params.prompt_logprobs)
                request.prompt_logprobs.append(self.to_logprobs(top))


def _top_and_actual(logprobs: torch.Tensor, token: int, num_top: int) -> dict[int, tuple[float, int]]:
    """The ``num_top`` most likely tokens and the actual ``token``, each as (logprob, rank)."""
    top = {}
    if num_top > 0:
        values, indices = logprobs.topk(num_top)
        top = {i: (v, r) for r, (v, i) in enumerate(zip(values.tolist(), indices.tolist()), start=1)}
    if token not in top:
        value = logprobs[token]
        top[token] = (float(value), int((logprobs > value).sum()) + 1)
    return top


# ---- what a stream reader sees ----------------------------------------------------------------

def stream_output(delta: RequestDelta) -> StreamOutput:
    """One sample's step as a :class:`StreamOutput` (not yet marked as the request's last)."""
    request = delta.request
    wants_logprobs = request.sampling_params.logprobs is not None and delta.new_token_ids
    return StreamOutput(
        request_id=request.group_id,
        delta_text=delta.new_text,
        delta_token_ids=list(delta.new_token_ids),
        index=request.sample_index,
        finish_reason=request.finish_reason if delta.is_finished else None,
        stop_reason=request.stop_reason if delta.is_finished else None,
        logprobs=request.logprobs[-len(delta.new_token_ids):] if wants_logprobs else None,
    )


def mark_last(output: StreamOutput, children: list[Request]) -> StreamOutput:
    """Make ``output`` the request's last: finished, with usage and the prompt (ids, text, logprobs)."""
    first = children[0]
    output.finished = True
    output.usage = usage_of(children)
    output.prompt_token_ids = first.prompt_token_ids
    output.prompt = first.prompt
    output.prompt_logprobs = first.prompt_logprobs or None
    output.lora_name = first.lora_name
    return output


def usage_of(children: list[Request]) -> Usage:
    first = children[0]
    return Usage(prompt_tokens=first.num_prompt_tokens,
                 completion_tokens=sum(child.num_output_tokens for child in children),
                 cached_tokens=max(first.num_cached_tokens, 0))
