"""Gives requests KV blocks: prefix-cache lookups on admission, new blocks as they grow, frees on exit."""
from __future__ import annotations

import json
from collections import OrderedDict

from .block_pool import BlockPool, hash_blocks
from .request import Request


class KVCacheManager:
    """Owns the mapping request → blocks on top of a :class:`BlockPool`.

    A block enters the prefix cache as soon as it is allocated for a step that fills it with
    known tokens (as vLLM does), not after that step ran; its hash chains to its parent's, so a
    lookup walks a prompt block by block until the first miss. A later request of the same step
    can then hit a block an earlier one is computing: each layer writes the step's keys and
    values before its attention reads them, so a burst of requests over one new document
    computes the document once.

    Every successful :meth:`allocate_slots` is for a request the scheduler runs this step. Until
    that step ran, its computed count stays below the blocks it registered ahead; a request freed
    in that window (its forward pass failed) takes those entries out of the cache again, so no
    later step is served a block whose KV was never written.

    >>> manager = KVCacheManager(num_blocks=64, block_size=16)
    >>> manager.allocate_slots(first, 70)                    # first's 4 full blocks are registered
    True
    >>> len(manager.find_cached_prefix(second))              # same prefix, same step: hits them
    4
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # first block's hash → (token ids, block hashes) of the latest request holding blocks that began
        # with that block: a burst over one prefix copies the prefix's hashes instead of hashing it again
        # per request (an entry goes when its request frees its blocks, so it keeps no finished prompt alive)
        self._recent_prompts: OrderedDict[bytes, tuple[list[int], list[bytes]]] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens (the last token is
        always left to compute, since its logits are needed)."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return []
        self._extend_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits, lookup = [], self.pool.cached_blocks.get   # (a burst looks up ~10^4 blocks per step)
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False (and no change) if there
        are not enough free blocks."""
        num_cached_tokens = len(cached_block_ids) * self.block_size
        num_tokens_after = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_blocks_needed = -(-num_tokens_after // self.block_size)
        num_new_blocks = num_blocks_needed - len(request.block_ids) - len(cached_block_ids)
        num_cached_in_free_queue = list(map(self.pool.ref_counts.__getitem__, cached_block_ids)).count(0)
        if num_new_blocks > self.pool.num_free_blocks - num_cached_in_free_queue:
            return False
        if cached_block_ids:
            self.pool.touch(list(cached_block_ids))
            request.block_ids.extend(cached_block_ids)
            request.num_computed_tokens += num_cached_tokens
            self.num_cached_blocks[request.request_id] = len(request.block_ids)
        if num_new_blocks > 0:
            request.block_ids.extend(self.pool.allocate(num_new_blocks))
        # Known tokens only: proposals to verify and a pending token are not in token_ids, so a
        # block they would complete waits until they are accepted (after a rollback, if any).
        self._cache_full_blocks(request, min(num_tokens_after, request.num_tokens))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full of computed tokens (those that did not
        fill with known tokens when they were allocated: a block that ends in a pending token)."""
        self._cache_full_blocks(request, request.num_computed_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks full within its first ``num_tokens`` tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_ids))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._extend_block_hashes(request)
        for index in range(start, num_full):
            self.pool.cache_block(request.block_ids[index], request.block_hashes[index])
        self.num_cached_blocks[request.request_id] = num_full

    def free_uncomputed_blocks(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens: after a verification step the
        KV of rejected proposals is garbage, and the blocks that held only that go back to the pool.
        (Their slots in the last kept block are simply overwritten by the next tokens; no hash
        covers them, since blocks are hashed only once full of accepted, computed tokens.)"""
        num_needed = -(-request.num_computed_tokens // self.block_size)
        if len(request.block_ids) > num_needed:
            # reused first: the next step allocates them again (see BlockPool.free)
            self.pool.free(list(reversed(request.block_ids[num_needed:])), reuse_first=True)
            del request.block_ids[num_needed:]

    def free(self, request: Request) -> None:
        """Give back all the request's blocks. Those it registered ahead of a step that never ran
        (past its computed tokens) leave the prefix cache first: their KV was never written."""
        self._uncache_uncomputed_blocks(request)
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids.clear()
        self.num_cached_blocks.pop(request.request_id, None)
        self._forget_recent_prompt(request)

    def _forget_recent_prompt(self, request: Request) -> None:
        if request.block_hashes:
            entry = self._recent_prompts.get(request.block_hashes[0])
            if entry is not None and entry[0] is request.token_ids:
                del self._recent_prompts[request.block_hashes[0]]

    def _uncache_uncomputed_blocks(self, request: Request) -> None:
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        num_computed = min(request.num_computed_tokens // self.block_size, num_cached)
        for block_id in request.block_ids[num_computed:num_cached]:
            self.pool.uncache_block(block_id)

    def _extend_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        end = request.num_tokens // self.block_size * self.block_size
        if not hashes and end:
            self._copy_recent_prefix_hashes(request)
        start = len(hashes) * self.block_size
        if end > start:
            hashes.extend(hash_blocks(hashes[-1] if hashes else None, request.token_ids[start:end], self.block_size,
                                      _extra_key(request)))

    def _copy_recent_prefix_hashes(self, request: Request) -> None:
        """Start the request's hashes with its first block's, then those of every following block
        it shares with the latest request that began with the same block (equal first hashes: equal
        tokens and extra key, so equal chains as far as the tokens agree)."""
        block_size, hashes = self.block_size, request.block_hashes
        first = hash_blocks(None, request.token_ids[:block_size], block_size, _extra_key(request))[0]
        recent = self._recent_prompts.pop(first, None)
        if recent is not None and recent[1] and recent[1][0] == first:  # (a list re-hashed in another regime: not)
            recent_tokens, recent_hashes = recent
            num_blocks = min(len(recent_hashes), request.num_tokens // block_size)
            hashes.extend(recent_hashes[:_num_common_blocks(request.token_ids, recent_tokens, num_blocks, block_size)])
        else:
            hashes.append(first)
        self._recent_prompts[first] = (request.token_ids, hashes)
        if len(self._recent_prompts) > _MAX_RECENT_PROMPTS:
            self._recent_prompts.popitem(last=False)


_MAX_RECENT_PROMPTS = 256   # (a bound for requests that look a prefix up and never get blocks)


def _num_common_blocks(tokens: list[int], other: list[int], num_blocks: int, block_size: int) -> int:
    """How many of the first ``num_blocks`` blocks two token lists share, the first known equal
    (block-sized slices compared in C: ~5x cheaper than hashing the blocks)."""
    count = 1
    while count < num_blocks and \
            tokens[count * block_size:(count + 1) * block_size] == other[count * block_size:(count + 1) * block_size]:
        count += 1
    return count


def _extra_key(request: Request) -> str | None:
    """What besides the tokens a block's KV depends on: the caller's salt and the model's KV regime
    (encoded together, so no salt a caller picks can stand for another salt plus a regime)."""
    if request.kv_regime is None and request.cache_salt is None and request.lora is None:
        return None
    if request.lora is not None:  # an adapter changes every layer's KV: its exact weights are part of the key
        return json.dumps([request.cache_salt, request.kv_regime, request.lora.cache_key])
    return json.dumps([request.cache_salt, request.kv_regime])
