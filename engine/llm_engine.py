"""The engine loop: admit requests, then step: schedule → execute → sample → update.

Admission is :mod:`.input_processor` (check, tokenize, fan out ``n``); the batch the scheduler
hands the runner is :mod:`.batch`; accepting tokens, stop checks and detokenizing is
:mod:`.output_processor`. What stays here is the order of things, and what fails when.
"""
from __future__ import annotations

import contextlib
import logging
import time
from concurrent import futures
from dataclasses import dataclass

import torch

from .batch import ScheduledBatch
from .config import EngineConfig
from .input_processor import BatchRejectedError, InputProcessor, Prompt, RequestInput, request_input
from .kv_cache_manager import KVCacheManager
from .lora.manager import LoRAConfig
from .loader import load_checkpoint
from .metrics import EngineMetrics, StepStats
from .errors import EngineDeadError
from .executor import make_executor
from .output_processor import OutputProcessor, RequestDelta
from .request import Request
from .sampler import SampledTokens, Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .spec_decode import NgramProposer, SpecDecodeStats, accepted_tokens, step_costs_for
from .structured_output import GrammarError, GuidedDecoder
from .thread_governor import ThreadGovernor

__all__ = ["LLMEngine", "RequestDelta"]

logger = logging.getLogger("hearth_llm")


@dataclass(slots=True)
class InFlightStep:
    """A step launched on the device whose tokens the host has not read yet."""

    requests: list[Request]          # each sampled request; its rows of ``sampled`` follow the previous one's
    sampled: SampledTokens
    can_sample_ahead: bool           # whether the next step may be scheduled before these are read
    proposals: list[list[int]]       # per request, the proposals it verified (1 + len rows of ``sampled``)


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
        checkpoint.quantization = config.quantization  # checked with the model before weights are read
        self.tokenizer = checkpoint.tokenizer
        self.hf_config = checkpoint.config
        # the model runner in this process, or one worker process per tensor-parallel rank
        self.runner = make_executor(config, checkpoint, lora_config=_lora_config(config))
        del checkpoint
        self.arch = self.runner.arch
        self.vocab_size = self.arch.vocab_size
        self.max_model_len = self._resolve_max_model_len()
        if config.speculative is not None:  # verification steps (1 + k tokens a sequence) get graphs too
            self.runner.num_speculative_tokens = config.speculative.num_speculative_tokens
        if config.cuda_graphs:
            self.runner.enable_cuda_graphs(min(config.max_num_seqs, 512), self.max_model_len)
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   kv_regime_of=getattr(self.runner.model, "kv_regime", None),
                                   max_loras=config.max_loras if config.enable_lora else None)
        self.sampler = Sampler(config.seed)
        self.guided_decoder = GuidedDecoder(self.tokenizer, self.vocab_size, config.grammar_compile_timeout)
        self.eos_token_ids = self._eos_token_ids()
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids,
                                              config.enable_prefix_caching, lora_manager=self.runner.lora)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}
        self.num_prompt_tokens_total = 0
        self.lora_manager = self.runner.lora  # None unless enable_lora
        self.num_steps = 0
        self.num_scheduled_requests = 0  # summed over steps: divided by num_steps, the mean batch size
        self.max_num_scheduled_requests = 0
        self.metrics = EngineMetrics(config.model)
        self.async_scheduling = (device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self.proposer, self.spec_stats = self._speculation(config.speculative)
        if self.proposer is not None:
            self.async_scheduling = False  # a proposal needs the tokens before it (EngineConfig refuses True)
        self._in_flight: InFlightStep | None = None
        is_governed = device.type == "cpu" and config.adaptive_threads and config.num_threads > 1
        self.thread_governor = ThreadGovernor(config.num_threads) if is_governed else None

    @property
    def detokenizers(self) -> dict:
        """Each sequence's incremental detokenizer, by request id (the output processor's)."""
        return self.output_processor.detokenizers

    @detokenizers.setter
    def detokenizers(self, value: dict) -> None:
        self.output_processor.detokenizers = value

    # ---- admission -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request=None,
    ) -> str:
        """Validate and queue a prompt (text, token ids or a ``ChatPrompt``); returns its request
        id. Nothing changes if validation fails."""
        request = request_input(prompt, sampling_params, request_id, priority, cache_salt, lora_request)
        self._admit(self.input_processor.process_one(request, self.groups))
        return request.request_id

    def add_requests(self, requests: list[RequestInput]) -> None:
        """Queue checked inputs (see :func:`.input_processor.request_input`) all at once, or none:
        :class:`BatchRejectedError` names the first that failed."""
        groups = self.input_processor.process(requests, self.groups)
        for index, children in enumerate(groups):
            try:
                self._admit(children)
            except Exception as error:  # not expected after the checks; still, all or none
                for admitted in groups[:index]:
                    self.abort_request(admitted[0].group_id)
                    self.release(admitted[0].group_id)
                raise BatchRejectedError(index, error) from error

    def _admit(self, children: list[Request]) -> None:
        first = children[0]
        params = first.sampling_params
        if params.structured_output is not None:
            future, submitted_at = self.guided_decoder.submit(params.structured_output), time.monotonic()
            for child in children:
                child.grammar_future, child.grammar_submitted_at = future, submitted_at
        self.groups[first.group_id] = children
        self.num_prompt_tokens_total += first.num_prompt_tokens
        self.metrics.on_request_added(first.num_prompt_tokens)
        for child in children:
            self.requests[child.request_id] = child
            self.output_processor.add_request(child)
            self.scheduler.add(child)

    # ---- the loop --------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    def step(self) -> list[RequestDelta]:
        """Schedule → execute → sample → update; returns what changed.

        With async scheduling the step is launched on the device and the tokens returned are the
        previous step's: the host schedules and prepares step N+1 while the device runs step N.
        A step whose requests need their last token seen before the next draw (grammars,
        penalties, min_tokens) is finished before the next one is scheduled.
        """
        deltas = self._attach_compiled_grammars()
        previous, self._in_flight = self._in_flight, None
        if previous is not None and not previous.can_sample_ahead:
            deltas += self._update(previous)
            previous = None
        batch = self.scheduler.schedule(self._propose() if previous is None else None)
        launched = None
        if not batch.is_empty:
            with self._cpu_threads_for(batch):
                clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
                started = clock()
                launched, failures = self._execute_and_sample(batch, previous)
                self._observe_step_cost(batch, clock() - started)
            deltas += failures
        if previous is not None:
            deltas += self._update(previous)  # the device ran it while this step was prepared
        if launched is not None and self.async_scheduling:
            self._in_flight = launched
        elif launched is not None:
            deltas += self._update(launched)
        elif batch.is_empty and previous is None:
            self._wait_for_grammars()
        if self.proposer is not None:
            self.proposer.forget_finished()
        self.metrics.on_step(StepStats.collect(deltas, self.stats()))
        return deltas

    def _propose(self) -> dict[str, list[int]]:
        """Proposals for each running request that decodes one token at a time and may speculate:
        at most ``num_speculative_tokens``, fewer near ``max_tokens`` or the end of the context."""
        if self.proposer is None:
            return {}
        requests, room = [], []
        for request in self.scheduler.running:
            if not self._may_speculate(request):
                continue
            max_tokens = request.sampling_params.max_tokens
            num_left = self.max_model_len - request.num_tokens
            if max_tokens is not None:
                num_left = min(num_left, max_tokens - request.num_output_tokens)
            # one of the tokens left is the target's own draw after the accepted proposals
            num_room = min(self.config.speculative.num_speculative_tokens, num_left - 1)
            if num_room > 0:
                requests.append(request)
                room.append(num_room)
        if not requests:
            return {}
        proposals = self.proposer.propose(requests, room)
        return {r.request_id: p for r, p in zip(requests, proposals) if p}

    def _observe_step_cost(self, batch: ScheduledBatch, seconds: float) -> None:
        """Tell the proposer's measured step costs (CPU n-gram) how long a one-request decode or
        verify step took (prefill chunks are left out: their rows cost otherwise)."""
        observe = getattr(getattr(self.proposer, "step_cost", None), "observe", None)
        if observe is None or len(batch.requests) != 1:
            return
        num_rows = batch.num_new_tokens[0]
        if num_rows == 1 + len(batch.proposals_of(0)) and batch.requests[0].num_output_tokens > 0:
            observe(num_rows, seconds)

    @staticmethod
    def _may_speculate(request: Request) -> bool:
        """Decoding (not prefilling, nothing in flight), asked for, and drawn from logits that do not
        depend on the tokens before them in the same step: no grammar, penalties or min_tokens left."""
        params = request.sampling_params
        return (params.speculative and request.num_pending_tokens == 0
                and request.num_computed_tokens == request.num_tokens - 1
                and request.grammar_future is None and request.matcher is None and not params.needs_penalties
                and request.num_output_tokens >= params.min_tokens)

    def _cpu_threads_for(self, batch: ScheduledBatch):
        if self.thread_governor is None:
            return contextlib.nullcontext()
        return self.thread_governor.threads_for(batch.num_scheduled_tokens)

    def _execute_and_sample(self, batch: ScheduledBatch, previous: InFlightStep | None):
        """Queue the forward pass and the draws on the device; returns (the step, failure deltas)."""
        try:
            # requests with a pending token read it from the previous step's draws, on the device
            output = self.runner.run(batch, None if previous is None else previous.sampled.token_ids)
        except EngineDeadError:  # the device is gone (a tensor-parallel worker died): stop the engine
            raise
        except Exception as error:  # a failed forward pass fails this step's requests, not the engine
            logger.exception("forward pass failed; aborting the %d requests of this step", len(batch.requests))
            return None, self._fail_requests(batch.requests, error)
        self.scheduler.update_after_step(batch)
        self._count_step(batch)
        to_sample = [batch.requests[i] for i in output.sampling_rows]
        if not to_sample:
            return None, []
        proposals = [batch.proposals_of(i) for i in output.sampling_rows]
        # A request verifying k proposals has k + 1 logits rows, each drawn as a decode step would be.
        rows = [request for request, spec in zip(to_sample, proposals) for _ in range(1 + len(spec))]
        try:
            self.output_processor.record_prompt_logprobs(batch.requests, output.prompt_logits)
            sampled = self.sampler(output.logits, rows, self.guided_decoder.apply_masks, output.greedy_token_ids)
        except Exception as error:  # e.g. a grammar mask that raises: fail this step's requests, keep serving
            logger.exception("sampling failed; aborting the %d requests of this step", len(batch.requests))
            return None, self._fail_requests(batch.requests, error)
        sampled.start_copy()
        row = 0
        for request, spec in zip(to_sample, proposals):
            request.num_pending_tokens += 1
            request.pending_row = row  # (read only without speculation, where each request has one row)
            row += 1 + len(spec)
        return InFlightStep(to_sample, sampled, all(r.can_sample_ahead for r in to_sample), proposals), []

    def _update(self, step: InFlightStep) -> list[RequestDelta]:
        """Wait for a launched step's tokens and accept them (stop checks, detokenizing)."""
        try:
            token_ids, logprobs = step.sampled.to_host()
        except Exception as error:
            logger.exception("a step failed on the device; aborting its %d requests", len(step.requests))
            for request in step.requests:
                request.num_pending_tokens -= 1
            return self._fail_requests([r for r in step.requests if not r.is_finished], error)
        deltas = []
        end = 0
        for request, spec in zip(step.requests, step.proposals):
            start, end = end, end + 1 + len(spec)
            request.num_pending_tokens -= 1
            if request.is_finished:  # aborted, or stopped by the token before this one
                continue
            try:
                if spec:
                    delta, finish = self._accept_verified(request, spec, token_ids[start:end], logprobs[start:end])
                else:
                    delta, finish = self.output_processor.accept_token(request, token_ids[start], logprobs[start])
            except Exception as error:  # e.g. detokenization: fails this request only
                logger.exception("request %s failed after sampling", request.request_id)
                deltas.extend(self._fail_requests([request], error))
                continue
            deltas.append(delta)
            if finish is not None:
                self.scheduler.finish(request, *finish)
            else:
                self.scheduler.cache_computed_blocks(request)
        return deltas

    def _accept_verified(self, request: Request, spec: list[int], drawn: list[int], logprobs: list):
        """Keep the longest agreeing prefix of the proposals plus the target's next draw; roll the
        KV of the rest back before the prefix cache sees the request's blocks."""
        tokens = accepted_tokens(spec, drawn)
        self.spec_stats.record(len(spec), len(tokens) - 1)
        accepted = self.output_processor.accept_tokens(request, tokens, logprobs[:len(tokens)])
        self.scheduler.roll_back_rejected(request)
        return accepted

    def _count_step(self, batch: ScheduledBatch) -> None:
        self.num_steps += 1
        self.num_scheduled_requests += len(batch.requests)
        self.max_num_scheduled_requests = max(self.max_num_scheduled_requests, len(batch.requests))

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
            self.output_processor.forget(child.request_id)

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
            "num_generation_tokens": self.output_processor.num_generation_tokens,
            "num_steps": self.num_steps,
            "num_scheduled_requests": self.num_scheduled_requests,
            "max_num_scheduled_requests": self.max_num_scheduled_requests,
            **(self.spec_stats.as_dict() if self.spec_stats is not None else {}),
        }

    # ---- setup helpers --------------------------------------------------------------------

    def _speculation(self, spec):
        """The proposer and the acceptance counters ``config.speculative`` asks for (None, None: off)."""
        if spec is None:
            return None, None
        if spec.method == "ngram":
            step_cost = step_costs_for(self.config.torch_device.type) if spec.adaptive_proposal_length else None
            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.prompt_lookup_backoff, step_cost)
        else:
            from .spec_decode.draft_model_proposer import DraftModelProposer

            proposer = DraftModelProposer(spec, self.config, self.vocab_size)
        return proposer, SpecDecodeStats(spec.num_speculative_tokens)

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


def _lora_config(config: EngineConfig) -> LoRAConfig | None:
    if not config.enable_lora:
        return None
    return LoRAConfig(config.max_loras, config.max_lora_rank, config.max_cpu_loras)
