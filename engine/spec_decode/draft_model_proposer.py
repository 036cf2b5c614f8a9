"""A small model that shares the target's tokenizer proposes the next tokens greedily.

The draft runs in its own :class:`ModelRunner` with its own KV pool and :class:`KVCacheManager`
(no prefix caching): its blocks are sized by its own layers, and a full draft pool only means
fewer proposals, never a preempted target request. Per target request it keeps a shadow
sequence; after a verification step the shadow's computed tokens are cut back to what it has in
common with the target's accepted tokens, so only the accepted tail is fed again.
"""
from __future__ import annotations

import torch

from ..batch import ScheduledBatch
from ..kv_cache_manager import KVCacheManager
from ..loader import load_checkpoint
from ..model_runner import ModelRunner
from ..request import Request
from ..sampling_params import SamplingParams
from .config import SpeculativeConfig

_SHADOW_PARAMS = SamplingParams(temperature=0.0, max_tokens=None)


class DraftModelProposer:
    """Greedy proposals from a draft model, batched over the requests, one draft pass per token.

    >>> proposer = DraftModelProposer(spec_config, engine_config, target_vocab_size=49152)
    >>> proposer.propose(requests, max_num_tokens=[4, 4])
    [[17, 42, 5, 9], [3, 3, 8, 1]]
    """

    def __init__(self, spec: SpeculativeConfig, engine_config, target_vocab_size: int) -> None:
        device, dtype = engine_config.torch_device, engine_config.torch_dtype
        checkpoint = load_checkpoint(spec.model, dtype, allow_pickle=engine_config.allow_pickle,
                                     trust_remote_code=engine_config.trust_remote_code,
                                     progress=engine_config.show_progress)
        self.runner = ModelRunner(checkpoint, device, dtype, engine_config.block_size, spec.kv_cache_memory)
        del checkpoint
        if self.runner.arch.vocab_size > target_vocab_size:
            raise ValueError(f"speculative.model has a vocabulary of {self.runner.arch.vocab_size} tokens, more than "
                             f"the target's {target_vocab_size}: the draft must share the target's tokenizer")
        self.kv_cache = KVCacheManager(self.runner.num_blocks, engine_config.block_size, enable_prefix_caching=False)
        if engine_config.cuda_graphs:  # the draft's k - 1 single-token steps per proposal replay graphs (CUDA only)
            max_len = min(self.runner.arch.max_position_embeddings, self.runner.num_blocks * engine_config.block_size)
            self.runner.enable_cuda_graphs(min(engine_config.max_num_seqs, 512), max_len)
        # request id → (target request, its draft sequence, target tokens copied at the last sync)
        self.shadows: dict[str, tuple[Request, Request, int]] = {}

    def propose(self, requests: list[Request], max_num_tokens: list[int]) -> list[list[int]]:
        """One greedy proposal per request, each at most its ``max_num_tokens`` long (shorter
        when the draft's pool is full)."""
        proposals: list[list[int]] = [[] for _ in requests]
        shadows = [self._synced_shadow(request) for request in requests]
        active = [i for i, k in enumerate(max_num_tokens) if k > 0]
        while active:
            batch = ScheduledBatch()
            for i in active:
                shadow = shadows[i]
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if self.kv_cache.allocate_slots(shadow, num_new):
                    batch.requests.append(shadow)
                    batch.num_new_tokens.append(num_new)
            if batch.is_empty:
                break
            next_tokens = self._greedy_next(batch)
            drafted = {id(shadow): token for shadow, token in zip(batch.requests, next_tokens)}
            for shadow, num_new in zip(batch.requests, batch.num_new_tokens):
                shadow.num_computed_tokens += num_new
            still_active = []
            for i in active:
                token = drafted.get(id(shadows[i]))
                if token is None:
                    continue  # no room in the draft's pool this step
                shadows[i].token_ids.append(token)
                proposals[i].append(token)
                if len(proposals[i]) < max_num_tokens[i]:
                    still_active.append(i)
            active = still_active
        return proposals

    def forget_finished(self) -> None:
        """Free the draft blocks of target requests that have finished (or been aborted)."""
        for request_id, (request, shadow, _) in list(self.shadows.items()):
            if request.is_finished:
                self.kv_cache.free(shadow)
                del self.shadows[request_id]

    @torch.inference_mode()
    def _greedy_next(self, batch: ScheduledBatch) -> list[int]:
        output = self.runner.run(batch)
        return output.logits.argmax(dim=-1).tolist()

    def _synced_shadow(self, request: Request) -> Request:
        """The draft's sequence for ``request``, its tokens made the target's and its computed
        count cut back to the prefix both agree on (the proposals the target rejected go)."""
        entry = self.shadows.get(request.request_id)
        if entry is not None and entry[0] is not request:  # an id reused after its request finished
            self.kv_cache.free(entry[1])
            entry = None
        if entry is None:
            shadow = Request(request.request_id, list(request.token_ids), _SHADOW_PARAMS, frozenset())
            self.shadows[request.request_id] = (request, shadow, request.num_tokens)
            return shadow
        _, shadow, num_synced = entry
        # The first num_synced tokens were copied from the target, whose tokens are only appended to.
        num_common = _common_prefix_length(shadow.token_ids, request.token_ids, num_synced)
        shadow.token_ids = list(request.token_ids)
        self.shadows[request.request_id] = (request, shadow, request.num_tokens)
        # The last token is always fed again: the next proposal comes from its logits.
        num_reusable = min(num_common, request.num_tokens - 1)
        if num_reusable < shadow.num_computed_tokens:
            shadow.num_computed_tokens = num_reusable
            self.kv_cache.free_uncomputed_blocks(shadow)
        return shadow


def _common_prefix_length(a: list[int], b: list[int], known: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, whose first ``known`` tokens agree."""
    length, end = known, min(len(a), len(b))
    while length < end and a[length] == b[length]:
        length += 1
    return length
