"""The pool of KV cache blocks: reference counts, a free queue in LRU order, and the prefix-hash index."""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from array import array

# Salted per process so cache keys can't be predicted or matched across processes.
_PROCESS_SALT = os.urandom(16)


def hash_block_tokens(parent_hash: bytes | None, token_ids, extra_key: str | None = None) -> bytes:
    """Hash of one full block, chained to the block before it; ``extra_key`` isolates tenants."""
    digest = hashlib.sha256(_PROCESS_SALT)
    digest.update(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        digest.update(b"salt:" + extra_key.encode())
    return digest.digest()


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Hands out blocks; a freed block keeps its contents (and cache entry) until it is reused.

    The free queue is ordered least-recently-used first, so eviction takes the block whose
    prefix was needed longest ago.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks with {len(self.free_queue)} free")
        block_ids = []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks, pulling unreferenced ones out of the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; pass a sequence's blocks tail first so its tail is evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, computed block under its hash (first writer wins on duplicates)."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block_id

    def uncache_block(self, block_id: int) -> None:
        """Take a block's entry out of the prefix-hash index (its KV is not what its hash says)."""
        self._evict(self.blocks[block_id])

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block.block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
