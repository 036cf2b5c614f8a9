"""The engine loop: admit requests, schedule a step, run the model, sample, detokenize, finish."""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
import uuid
from concurrent import futures
from dataclasses import dataclass

import torch

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache_manager import KVCacheManager
from .metrics import EngineMetrics
from .loader import load_checkpoint
from .model_runner import ModelRunner
from .outputs import Logprob
from .request import Request
from .sampler import SampledTokens, Sampler
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .structured_output import GrammarError, GuidedDecoder
from .thread_governor import ThreadGovernor

logger = logging.getLogger("hearth_llm")


@dataclass(slots=True)
class RequestDelta:
    """What one step changed for one sequence."""

    request: Request
    new_token_ids: list[int]
    new_text: str
    is_finished: bool
    error: BaseException | None = None


@dataclass(slots=True)
class InFlightStep:
    """A step launched on the device whose tokens the host has not read yet."""

    requests: list[Request]          # one per row of ``sampled``
    sampled: SampledTokens
    can_sample_ahead: bool           # whether the next step may be scheduled before these are read


class LLMEngine:
    """Synchronous core shared by :class:`LLM` and :class:`AsyncLLM`; not thread-safe by itself.

    >>> engine = LLMEngine(EngineConfig(model="default"))
    >>> engine.add_request("Hello", SamplingParams(max_tokens=8))
    >>> while engine.has_unfinished_requests():
    ...     for delta in engine.step(): print(delta.new_text, end="")
    """

    def __init__(self, config: EngineConfig, checkpoint=None) -> None:
        """``checkpoint`` (a LoadedCheckpoint) skips loading ``config.model``: benchmarks use it
        for random-weight models built in memory."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device, dtype = config.torch_device, config.torch_dtype
        if checkpoint is None:
            checkpoint = load_checkpoint(config.model, dtype, allow_pickle=config.allow_pickle,
                                         trust_remote_code=config.trust_remote_code, progress=config.show_progress)
        self.tokenizer = checkpoint.tokenizer
        self.hf_config = checkpoint.config
        self.runner = ModelRunner(checkpoint, device, dtype, config.block_size, config.kv_cache_memory)
        del checkpoint
        self.arch = self.runner.arch
        self.vocab_size = self.arch.vocab_size
        self.max_model_len = self._resolve_max_model_len()
        if config.cuda_graphs:
            self.runner.enable_cuda_graphs(min(config.max_num_seqs, 512), self.max_model_len)
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.sampler = Sampler(config.seed)
        self.guided_decoder = GuidedDecoder(self.tokenizer, self.vocab_size, config.grammar_compile_timeout)
        self.eos_token_ids = self._eos_token_ids()
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrival_counter = itertools.count()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_steps = 0
        self.num_scheduled_requests = 0  # summed over steps: divided by num_steps, the mean batch size
        self.max_num_scheduled_requests = 0
        self.metrics = EngineMetrics(config.model)
        self.async_scheduling = (device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._in_flight: InFlightStep | None = None
        is_governed = device.type == "cpu" and config.adaptive_threads and config.num_threads > 1
        self.thread_governor = ThreadGovernor(config.num_threads) if is_governed else None

    # ---- admission -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a prompt; returns its request id. Nothing changes if validation fails."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        request_id = str(uuid.uuid4().hex) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize_prompt(prompt)
        self._check_token_ids(token_ids)
        self._check_max_tokens(token_ids, params)
        children = self._make_requests(request_id, text, token_ids, params, priority, cache_salt)
        self.groups[request_id] = children
        self.num_prompt_tokens_total += len(token_ids)
        self.metrics.on_request_added(len(token_ids))
        if params.structured_output is not None:
            future = self.guided_decoder.submit(params.structured_output)
            for child in children:
                child.grammar_future, child.grammar_submitted_at = future, time.monotonic()
        for child in children:
            self.requests[child.request_id] = child
            self.detokenizers[child.request_id] = IncrementalDetokenizer(
                self.tokenizer, params.stop_strings, params.skip_special_tokens, params.include_stop_str_in_output)
            self.scheduler.add(child)
        return request_id

    def check_prompt(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> list[int]:
        """The prompt's token ids, or ValueError naming what is wrong; changes nothing."""
        _, token_ids = self._tokenize_prompt(prompt)
        self._check_token_ids(token_ids)
        if sampling_params is not None:
            self._check_max_tokens(token_ids, sampling_params)
        return token_ids

    def _tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")

    def _check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
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

    def _make_requests(self, request_id, text, token_ids, params, priority, cache_salt) -> list[Request]:
        n = params.n
        children = []
        for index in range(n):
            child = Request(
                request_id=request_id if n == 1 else f"{request_id}#{index}",
                prompt_token_ids=token_ids, sampling_params=params, eos_token_ids=self.eos_token_ids,
                priority=priority, prompt=text, group_id=request_id, sample_index=index,
                cache_salt=cache_salt, arrival_order=next(self._arrival_counter),
            )
            # Siblings reuse the first sample's prompt blocks through the prefix cache.
            if index > 0 and self.config.enable_prefix_caching:
                child.waits_for = children[0]
            children.append(child)
        return children

    # ---- the loop --------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    def step(self) -> list[RequestDelta]:
        """Run one scheduling step and one forward pass; returns what changed.

        With async scheduling the step is launched on the device and the tokens returned are the
        previous step's: the host schedules and prepares step N+1 while the device runs step N.
        A step whose requests need their last token seen before the next draw (grammars,
        penalties, min_tokens) is finished before the next one is scheduled.
        """
        deltas = self._attach_compiled_grammars()
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and not in_flight.can_sample_ahead:
            deltas += self._finish_step(in_flight)
            in_flight = None
        batch = self.scheduler.schedule()
        launched = None
        if not batch.is_empty:
            with self._cpu_threads_for(batch):
                launched, failures = self._launch_step(batch, in_flight)
            deltas += failures
        if in_flight is not None:
            deltas += self._finish_step(in_flight)
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
            else:
                deltas += self._finish_step(launched)
        elif batch.is_empty and in_flight is None:
            self._wait_for_grammars()
        self.metrics.on_step(self, deltas)
        return deltas

    def _cpu_threads_for(self, batch: ScheduledBatch):
        if self.thread_governor is None:
            return contextlib.nullcontext()
        return self.thread_governor.threads_for(batch.num_scheduled_tokens)

    def _launch_step(self, batch: ScheduledBatch, in_flight: "InFlightStep | None"):
        """Queue the forward pass and the draws on the device; returns (the step, failure deltas)."""
        try:
            # requests with a pending token read it from the in-flight step's draws, on the device
            output = self.runner.run(batch, None if in_flight is None else in_flight.sampled.token_ids)
        except Exception as error:  # a failed forward pass fails this step's requests, not the engine
            logger.exception("forward pass failed; aborting the %d requests of this step", len(batch.requests))
            return None, self._fail_requests(batch.requests, error)
        self.scheduler.update_after_step(batch)
        self.num_steps += 1
        self.num_scheduled_requests += len(batch.requests)
        self.max_num_scheduled_requests = max(self.max_num_scheduled_requests, len(batch.requests))
        to_sample = [batch.requests[i] for i in output.sampling_rows]
        if not to_sample:
            return None, []
        try:
            self._record_prompt_logprobs(batch, output.prompt_logits)
            sampled = self.sampler(output.logits, to_sample, self.guided_decoder.apply_masks)
        except Exception as error:  # e.g. a grammar mask that raises: fail this step's requests, keep serving
            logger.exception("sampling failed; aborting the %d requests of this step", len(batch.requests))
            return None, self._fail_requests(batch.requests, error)
        sampled.start_copy()
        for row, request in enumerate(to_sample):
            request.num_pending_tokens += 1
            request.pending_row = row
        return InFlightStep(to_sample, sampled, all(r.can_sample_ahead for r in to_sample)), []

    def _finish_step(self, step: "InFlightStep") -> list[RequestDelta]:
        """Wait for a launched step's tokens and accept them (stop checks, detokenizing)."""
        deltas = []
        try:
            token_ids, logprobs = step.sampled.to_host()
        except Exception as error:
            logger.exception("a step failed on the device; aborting its %d requests", len(step.requests))
            for request in step.requests:
                request.num_pending_tokens -= 1
            return self._fail_requests([r for r in step.requests if not r.is_finished], error)
        for row, request in enumerate(step.requests):
            request.num_pending_tokens -= 1
            if request.is_finished:  # aborted, or stopped by the token before this one
                continue
            try:
                deltas.append(self._accept_token(request, token_ids[row], logprobs[row]))
            except Exception as error:  # e.g. detokenization: fails this request only
                logger.exception("request %s failed after sampling", request.request_id)
                deltas.extend(self._fail_requests([request], error))
                continue
            if not request.is_finished:
                self.scheduler.cache_computed_blocks(request)
        return deltas

    def _attach_compiled_grammars(self) -> list[RequestDelta]:
        failures = []
        for request in [r for r in self.scheduler.waiting if r.is_waiting_for_grammar]:
            try:
                request.matcher = self.guided_decoder.matcher_for(request.grammar_future, request.grammar_submitted_at)
            except GrammarError as error:
                failures.extend(self._fail_requests([request], error))
        return failures

    def _wait_for_grammars(self) -> None:
        """Nothing to run but grammars compiling: wait briefly instead of spinning."""
        pending = [r.grammar_future for r in self.scheduler.waiting if r.is_waiting_for_grammar]
        if pending:
            futures.wait(pending, timeout=0.05, return_when=futures.FIRST_COMPLETED)

    def _fail_requests(self, requests: list[Request], error: BaseException) -> list[RequestDelta]:
        deltas = []
        for request in requests:
            self.scheduler.finish(request, "abort", f"error: {error}")
            deltas.append(RequestDelta(request, [], "", True, error))
        return deltas

    def _accept_token(self, request: Request, token_id: int, logprobs) -> RequestDelta:
        request.append_token(token_id)
        self.num_generation_tokens_total += 1
        if request.matcher is not None and not request.matcher.accept_token(token_id):
            raise GrammarError(f"token {token_id} was sampled outside the request's grammar")
        params = request.sampling_params
        detokenizer = self.detokenizers[request.request_id]
        past_min_tokens = request.num_output_tokens >= params.min_tokens
        stop_string = detokenizer.add_token(token_id, check_stop=past_min_tokens) if params.detokenize else None
        if logprobs is not None:
            request.logprobs.append(self._to_logprobs(logprobs))
        reason, stop_reason = self._finish_reason(request, token_id, stop_string, past_min_tokens)
        if reason is not None:
            self.scheduler.finish(request, reason, stop_reason)
        request.output_text = detokenizer.text
        return RequestDelta(request, [token_id], detokenizer.take_stream_delta(reason is not None), reason is not None)

    def _finish_reason(self, request: Request, token_id: int, stop_string, past_min_tokens: bool):
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
        return None, None

    def _to_logprobs(self, entries: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        return {token: Logprob(value, rank, self.tokenizer.decode([token])) for token, (value, rank) in entries.items()}

    def _record_prompt_logprobs(self, batch: ScheduledBatch, prompt_logits: dict[int, torch.Tensor]) -> None:
        for index, logits in prompt_logits.items():
            request = batch.requests[index]
            num_top = request.sampling_params.prompt_logprobs
            if not request.prompt_logprobs:
                request.prompt_logprobs.append(None)  # the first prompt token has no context
            end = request.num_computed_tokens  # already advanced past this chunk
            start = end - logits.shape[0]
            logprobs = torch.log_softmax(logits, dim=-1)
            for offset in range(logits.shape[0]):
                target = start + offset + 1
                if target >= request.num_prompt_tokens:
                    break
                token = request.prompt_token_ids[target]
                top = {}
                if num_top > 0:
                    values, indices = logprobs[offset].topk(num_top)
                    top = {i: (v, r) for r, (v, i) in enumerate(zip(values.tolist(), indices.tolist()), start=1)}
                if token not in top:
                    value = logprobs[offset, token]
                    top[token] = (float(value), int((logprobs[offset] > value).sum()) + 1)
                request.prompt_logprobs.append(self._to_logprobs(top))

    # ---- abort and bookkeeping ------------------------------------------------------------

    def abort_request(self, request_id: str) -> bool:
        """Finish a request (all its samples) now and free its blocks; False if unknown or done."""
        children = self.groups.get(request_id)
        if children is None and request_id in self.requests:
            children = [self.requests[request_id]]
        if not children:
            return False
        aborted = False
        for child in children:
            if not child.is_finished:
                self.scheduler.finish(child, "abort")
                aborted = True
        return aborted

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping once its output has been collected."""
        for child in self.groups.pop(request_id, []):
            self.requests.pop(child.request_id, None)
            self.detokenizers.pop(child.request_id, None)

    def stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": self.kv_cache.num_free_blocks,
            "num_total_blocks": self.kv_cache.num_total_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.kv_cache.prefix_cache_queries,
            "prefix_cache_hits": self.kv_cache.prefix_cache_hits,
            "num_prompt_tokens": self.num_prompt_tokens_total,
            "num_generation_tokens": self.num_generation_tokens_total,
            "num_steps": self.num_steps,
            "num_scheduled_requests": self.num_scheduled_requests,
            "max_num_scheduled_requests": self.max_num_scheduled_requests,
        }

    # ---- setup helpers --------------------------------------------------------------------

    def _resolve_max_model_len(self) -> int:
        capacity = self.runner.num_blocks * self.config.block_size
        model_limit = self.arch.max_position_embeddings
        requested = self.config.max_model_len
        if requested is not None:
            if requested > model_limit:
                raise ValueError(f"max_model_len={requested} exceeds the model's context of {model_limit} tokens")
            if requested > capacity:
                raise ValueError(
                    f"max_model_len={requested} does not fit the KV cache ({capacity} tokens); "
                    "raise kv_cache_memory or lower max_model_len")
            return requested
        if capacity < model_limit:
            logger.info("max_model_len capped at the KV cache capacity of %d tokens", capacity)
        return min(model_limit, capacity)

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set()
        config_eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(config_eos, int):
            ids.add(config_eos)
        elif isinstance(config_eos, (list, tuple)):
            ids.update(config_eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)
