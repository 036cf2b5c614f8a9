"""The pool of KV cache blocks: reference counts, a free queue in LRU order, and the prefix-hash index."""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from array import array

# Salted per process so cache keys can't be predicted or matched across processes.
_PROCESS_SALT = os.urandom(16)


_SALTED_SHA256 = hashlib.sha256(_PROCESS_SALT)
_TOKEN_BYTES = array("q").itemsize


def hash_block_tokens(parent_hash: bytes | None, token_ids, extra_key: str | None = None) -> bytes:
    """Hash of one full block, chained to the block before it; ``extra_key`` isolates tenants."""
    return hash_blocks(parent_hash, token_ids, len(token_ids), extra_key)[0]


def hash_blocks(parent_hash: bytes | None, token_ids, block_size: int, extra_key: str | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids`` that follow the block hashed
    ``parent_hash``: each as :func:`hash_block_tokens` gives it, from one buffer of the ids (a burst
    of 64 prompts of 2k tokens hashes 8k blocks, the largest host cost of its step).

    >>> first, second = hash_blocks(None, [1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    >>> second == hash_block_tokens(first, [5, 6, 7, 8])
    True
    """
    data = memoryview(array("q", token_ids)).cast("B")
    block_bytes = block_size * _TOKEN_BYTES
    suffix = None if extra_key is None else b"salt:" + extra_key.encode()
    hashes = []
    for start in range(0, len(token_ids) // block_size * block_bytes, block_bytes):
        digest = _SALTED_SHA256.copy()
        digest.update(parent_hash or b"root")
        digest.update(data[start:start + block_bytes])
        if suffix is not None:
            digest.update(suffix)
        parent_hash = digest.digest()
        hashes.append(parent_hash)
    return hashes


class KVBlock:
    """One block's state as ``pool.blocks[block_id]`` shows it: a view of the pool's arrays, so
    reading and writing ``ref_count`` and ``block_hash`` reads and writes the pool."""

    __slots__ = ("_pool", "block_id")

    def __init__(self, pool: BlockPool, block_id: int) -> None:
        self._pool, self.block_id = pool, block_id

    @property
    def ref_count(self) -> int:
        return self._pool.ref_counts[self.block_id]

    @ref_count.setter
    def ref_count(self, value: int) -> None:
        self._pool.ref_counts[self.block_id] = value

    @property
    def block_hash(self) -> bytes | None:
        return self._pool.block_hashes[self.block_id]

    @block_hash.setter
    def block_hash(self, value: bytes | None) -> None:
        self._pool.block_hashes[self.block_id] = value


class _BlockViews:
    """``pool.blocks``: a :class:`KVBlock` view for each id, made when asked for."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return len(self._pool.ref_counts)

    def __getitem__(self, block_id: int) -> KVBlock:
        return KVBlock(self._pool, range(len(self))[block_id])

    def __iter__(self):
        return (KVBlock(self._pool, block_id) for block_id in range(len(self)))


class BlockPool:
    """Hands out blocks; a freed block keeps its contents (and cache entry) until it is reused.

    The free queue is ordered least-recently-used first, so eviction takes the block whose
    prefix was needed longest ago. Each block's state is two list entries, not an object: a
    1 GiB CPU cache of a tiny model has ~10^5 blocks, and making an object for each took longer
    than the rest of the engine's start.

    >>> pool = BlockPool(4)
    >>> pool.allocate(2), pool.num_free_blocks, pool.blocks[0].ref_count
    ([0, 1], 2, 1)
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.blocks = _BlockViews(self)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks with {len(self.free_queue)} free")
        free_queue, ref_counts, block_hashes = self.free_queue, self.ref_counts, self.block_hashes
        block_ids = []
        for _ in range(count):
            block_id, _ = free_queue.popitem(last=False)
            if block_hashes[block_id] is not None:
                self._evict(block_id)
            ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks, pulling unreferenced ones out of the free queue."""
        ref_counts = self.ref_counts
        for block_id in block_ids:
            if ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            ref_counts[block_id] += 1

    def free(self, block_ids: list[int], reuse_first: bool = False) -> None:
        """Drop one reference each; pass a sequence's blocks tail first so its tail is evicted first.

        ``reuse_first``: blocks that hold no cached KV go to the front of the queue, so the next
        allocation gets them back (in sequence order: pass them tail first). A speculative step's
        rolled-back tail is allocated again a step later; getting the same block keeps a lone
        sequence's blocks one contiguous run, which the CPU attention reads as a view instead of
        gathering a copy in every layer."""
        ref_counts, free_queue = self.ref_counts, self.free_queue
        for block_id in block_ids:
            if ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                free_queue[block_id] = None
                if reuse_first and self.block_hashes[block_id] is None:
                    free_queue.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full block under its hash (first writer wins on duplicates)."""
        if not self.enable_prefix_caching:
            return
        if self.block_hashes[block_id] is not None or block_hash in self.cached_blocks:
            return
        self.block_hashes[block_id] = block_hash
        self.cached_blocks[block_hash] = block_id

    def uncache_block(self, block_id: int) -> None:
        """Take a block's entry out of the prefix-hash index (its KV is not what its hash says)."""
        if self.block_hashes[block_id] is not None:
            self._evict(block_id)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if self.cached_blocks.get(block_hash) == block_id:
            del self.cached_blocks[block_hash]
        self.block_hashes[block_id] = None
