"""Continuous batching: each step, every request moves its computed tokens toward its total
within one shared token budget. Prefill chunks, decodes and prefix hits all follow from that rule."""
from __future__ import annotations

import bisect

from typing import Callable

from .batch import ScheduledBatch
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


def _queue_key(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_order)


class Scheduler:
    """Priority-ordered (lower value first, then arrival) with preemption by recompute.

    ``kv_regime_of(num_tokens)`` is the model's name for how it computes the keys of a sequence
    of that length (Phi-3 longrope: short or long factors; None for most models). A request keeps
    all its KV in the regime of its current length: when it grows into a new one it is recomputed.

    ``max_loras``: at most that many distinct LoRA adapters run at once (the model's device
    slots); a waiting request of another adapter waits, while base and resident-adapter ones go on.

    Prefix sharing inside a step: a request's blocks enter the prefix cache when they are
    allocated (see :class:`KVCacheManager`), so a request admitted after it in the same step hits
    the blocks it is computing. No request waits for a prefix another is still computing: a
    chunk of a prompt stops short of its end only when the budget is spent, and then nothing
    after it is admitted this step; by the step its last chunk runs in, every block before it is
    registered. ``num_computed_prompt_tokens`` counts the prompt tokens run through the model
    (prefix hits excluded, recomputation after preemption included).
    """

    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 kv_regime_of: Callable[[int], str | None] | None = None, max_loras: int | None = None):
        self.kv_cache = kv_cache
        self.kv_regime_of = kv_regime_of
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=_queue_key)

    def schedule(self, proposals: dict[str, list[int]] | None = None) -> ScheduledBatch:
        """This step's batch. ``proposals`` (request id → proposed tokens) are scheduled as extra
        tokens of a decoding request, as far as its token budget and free blocks allow; a request
        never preempts another to make room for its proposals."""
        proposals = proposals or {}
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self.running.sort(key=_queue_key)
        scheduled_ids: dict[str, int] = {}   # request id → tokens it computes this step
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.num_pending_tokens and request.is_at_length_limit(self.max_model_len, request.num_pending_tokens):
                continue  # its pending token is its last: nothing more to compute
            if self._kv_regime_changed(request):
                self._requeue_for_recompute(request)  # its KV is in the old regime
                continue
            # A pending token (sampled by the step in flight) is fed from the device's copy of it.
            num_new = min(request.num_tokens + request.num_pending_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            spec = self._fit_proposals(request, proposals.get(request.request_id), budget)
            if spec and self.kv_cache.allocate_slots(request, 1 + len(spec)):
                batch.spec_token_ids[len(batch.requests)] = spec
                num_new = 1 + len(spec)
            elif not self._allocate_or_preempt(request, num_new, batch, scheduled_ids):
                continue
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            scheduled_ids[request.request_id] = num_new
            budget -= num_new
        if not batch.preempted:
            budget = self._admit_waiting(batch, budget, scheduled_ids)
        return batch

    def _fit_proposals(self, request: Request, spec: list[int] | None, budget: int) -> list[int]:
        """The proposals this step can verify: only for a decoding request (one token to compute,
        none in flight), within the budget, and not across a change of KV regime."""
        if not spec or request.num_pending_tokens or request.num_computed_tokens != request.num_tokens - 1:
            return []
        spec = spec[:budget - 1]
        if spec and self.kv_regime_of is not None and \
                self.kv_regime_of(request.num_tokens + len(spec)) != request.kv_regime:
            return []
        return spec

    def roll_back_rejected(self, request: Request) -> None:
        """After a verification step's tokens are accepted: the KV past the last accepted token is
        not the sequence's any more. Its computed count drops to the accepted tokens (the newest
        one, the target's own draw, is computed next step) and the blocks past them are freed."""
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv_cache.free_uncomputed_blocks(request)

    def _allocate_or_preempt(self, request: Request, num_new: int, batch: ScheduledBatch,
                             scheduled_ids: dict[str, int]) -> bool:
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = self._preemption_victim(scheduled_ids)
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preemption_victim(self, scheduled_ids: dict[str, int]) -> Request:
        """The lowest-priority, latest-arrived running request not already scheduled this step."""
        candidates = [r for r in self.running if r.request_id not in scheduled_ids]
        return max(candidates, key=_queue_key)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, scheduled_ids: dict[str, int]) -> int:
        running_loras = self._running_loras()
        for request in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if request.is_waiting_for_grammar or request.num_pending_tokens or not self._has_lora_slot(request, running_loras):
                continue  # (a preempted request's last token is still in flight)
            if request.waits_for is not None and not _prompt_is_scheduled(request.waits_for, scheduled_ids):
                continue
            request.waits_for = None
            if self._kv_regime_changed(request):
                request.kv_regime = self.kv_regime_of(request.num_tokens)
                request.block_hashes.clear()  # hashed in the old regime
            cached = self.kv_cache.find_cached_prefix(request)
            num_new = min(request.num_tokens - len(cached) * self.kv_cache.block_size, budget)
            if not self.kv_cache.allocate_slots(request, num_new, cached):
                break
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = len(cached) * self.kv_cache.block_size
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora is not None:
                running_loras.add(request.lora.cache_key)
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            scheduled_ids[request.request_id] = num_new
            budget -= num_new
        return budget

    def _running_loras(self) -> set[str]:
        return {r.lora.cache_key for r in self.running if r.lora is not None} if self.max_loras is not None else set()

    def _has_lora_slot(self, request: Request, running_loras: set[str]) -> bool:
        """Whether running ``request`` keeps the running adapters within ``max_loras``."""
        if request.lora is None or self.max_loras is None:
            return True
        return request.lora.cache_key in running_loras or len(running_loras) < self.max_loras

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and requeue it; it recomputes (often from the prefix cache)."""
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue_for_recompute(request)

    def _kv_regime_changed(self, request: Request) -> bool:
        if self.kv_regime_of is None:
            return False
        return self.kv_regime_of(request.num_tokens + request.num_pending_tokens) != request.kv_regime

    def _requeue_for_recompute(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, request, key=_queue_key)

    def update_after_step(self, batch: ScheduledBatch) -> None:
        """Count the tokens just computed and publish newly full blocks to the prefix cache."""
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            num_prompt_left = request.num_prompt_tokens - request.num_computed_tokens
            self.num_computed_prompt_tokens += max(0, min(num_new, num_prompt_left))
            request.num_computed_tokens += num_new
            self.cache_computed_blocks(request)

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish full blocks, once the host knows every token in them (a block that ends in a
        pending token waits for it)."""
        if request.num_computed_tokens <= request.num_tokens:
            self.kv_cache.cache_computed_blocks(request)

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """Take a request out of the queues and free its blocks (any state: waiting, running)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        if request.status is not RequestStatus.FINISHED:
            self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason


def _prompt_is_scheduled(request: Request, scheduled_ids: dict[str, int]) -> bool:
    """Whether ``request``'s prompt blocks are registered: computed, or being computed this step
    (a sibling admitted after it then hits them in the same step)."""
    num_computed_after_step = request.num_computed_tokens + scheduled_ids.get(request.request_id, 0)
    return request.is_finished or num_computed_after_step >= request.num_prompt_tokens - 1
