"""The KV cache tensor of a loaded engine: allocate, drop, and shrink it while requests run.

Shrinking keeps every block a request holds (and as many prefix-cached free blocks as fit,
most recently used first), renumbers them into the smaller cache, and rewrites the requests'
block tables and the prefix index to match. A request never notices, except that the pool is
smaller. Call these between engine steps only (the engine thread, or under its step lock).

>>> num_released = shrink_kv_cache(engine, engine.runner.num_blocks // 2)
"""
from __future__ import annotations

import numpy as np
import torch

from hearth_llm.kernels import cpu_ops

from ..block_pool import BlockPool


def kv_floor_blocks(engine) -> int:
    """The fewest blocks the engine may keep: one ``max_model_len`` sequence, which it promised."""
    return -(-engine.max_model_len // engine.config.block_size)


def num_used_blocks(engine) -> int:
    pool = engine.kv_cache.pool
    return pool.num_blocks - pool.num_free_blocks


def num_reclaimable_blocks(engine) -> int:
    """Free blocks above the floor: what a shrink can give back now."""
    pool = engine.kv_cache.pool
    return max(0, pool.num_blocks - max(kv_floor_blocks(engine), num_used_blocks(engine)))


def kv_cache_bytes(engine) -> int:
    runner = engine.runner
    return 0 if runner.kv_cache is None else runner.kv_cache.numel() * runner.kv_cache.element_size()


def shrink_kv_cache(engine, num_blocks: int) -> int:
    """Shrink the engine's KV cache to ``num_blocks`` (at least its used blocks and its floor);
    returns the number of blocks released."""
    runner, pool = engine.runner, engine.kv_cache.pool
    num_blocks = max(num_blocks, kv_floor_blocks(engine), num_used_blocks(engine))
    if num_blocks >= pool.num_blocks:
        return 0
    if runner.device.type != "cuda":
        return _shrink(engine, runner, pool, num_blocks)
    with torch.cuda.device(runner.device):       # (called on another engine's thread)
        torch.cuda.synchronize()                 # a step in flight writes KV into the blocks we move
        return _shrink(engine, runner, pool, num_blocks)


def _shrink(engine, runner, pool: BlockPool, num_blocks: int) -> int:
    keep = _blocks_to_keep(pool, num_blocks)
    new_id = {old: new for new, old in enumerate(keep)}
    runner.decode_graphs = None  # captured over the old tensor (re-captured below)
    set_kv_cache(runner, _compacted(runner, keep, num_blocks))
    engine.kv_cache.pool = _renumbered_pool(pool, keep, new_id, num_blocks)
    for request in engine.requests.values():
        if request.block_ids:
            request.block_ids[:] = [new_id[block_id] for block_id in request.block_ids]
    recapture_cuda_graphs(engine)
    return pool.num_blocks - num_blocks


def _blocks_to_keep(pool: BlockPool, num_blocks: int) -> list[int]:
    """Every block in use, then the free blocks with a prefix-cache entry, most recent first."""
    in_use = [block.block_id for block in pool.blocks if block.ref_count > 0]
    room = num_blocks - len(in_use)
    cached_free = [block_id for block_id in pool.free_queue if pool.blocks[block_id].block_hash is not None]
    kept_cached = cached_free[max(0, len(cached_free) - room):] if room > 0 else []
    return sorted(in_use + kept_cached)


def _renumbered_pool(old: BlockPool, keep: list[int], new_id: dict[int, int], num_blocks: int) -> BlockPool:
    pool = BlockPool(num_blocks, old.enable_prefix_caching)
    for old_id in keep:
        block = pool.blocks[new_id[old_id]]
        block.ref_count = old.blocks[old_id].ref_count
        block.block_hash = old.blocks[old_id].block_hash
        if block.block_hash is not None and old.cached_blocks.get(block.block_hash) == old_id:
            pool.cached_blocks[block.block_hash] = block.block_id
    # The free queue evicts from its front: the empty new blocks first, then the cached ones in
    # their old least-recently-used order.
    kept_free = [new_id[b] for b in old.free_queue if b in new_id]
    empty = [b for b in range(len(keep), num_blocks)]
    pool.free_queue.clear()
    for block_id in empty + kept_free:
        pool.free_queue[block_id] = None
    return pool


def _compacted(runner, keep: list[int], num_blocks: int) -> torch.Tensor:
    """The runner's cache as a ``num_blocks`` cache holding ``keep``'s blocks first. On a GPU the
    kept blocks wait in host memory, so the device never holds the old and the new cache at once."""
    cache = _as_stored(runner.kv_cache)
    shape = (*cache.shape[:2], num_blocks, *cache.shape[3:])
    index = torch.tensor(keep, dtype=torch.long, device=cache.device)
    if cache.device.type != "cuda":
        new = new_kv_cache(shape, cache.dtype, cache.device)
        new[:, :, :len(keep)] = cache.index_select(2, index)
        return new.view(runner.kv_cache.dtype)
    cache_dtype = runner.kv_cache.dtype
    staged = [cache[layer].index_select(1, index).to("cpu") for layer in range(cache.shape[0])]
    set_kv_cache(runner, None)
    del cache  # the last reference: the old cache goes back to the allocator here
    torch.cuda.empty_cache()
    new = torch.zeros(shape, dtype=staged[0].dtype, device=index.device)
    for layer, blocks in enumerate(staged):
        new[layer, :, :len(keep)].copy_(blocks)
    return new.view(cache_dtype)


def _as_stored(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as its bytes (index_select has no fp8 kernel); other caches as they are."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def set_kv_cache(runner, cache: torch.Tensor | None) -> None:
    """Give the runner a new cache tensor: the per-layer (key, value) views the model reads."""
    runner.kv_cache = cache
    runner.kv_caches = [] if cache is None else [(cache[i, 0], cache[i, 1]) for i in range(cache.shape[0])]
    runner.num_blocks = 0 if cache is None else cache.shape[2]


def new_kv_cache(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros. On the CPU through calloc, whose pages the OS zero-fills on first write (the default 1 GiB
    CPU cache otherwise costs ~0.4 s of memset at startup, mostly never touched), in 4 KiB pages:
    numpy asks for transparent huge pages on large arrays (``madvise(MADV_HUGEPAGE)``), and then the
    first write into each 2 MiB makes all of it resident (measured: the bundled SmolLM2's 64 MiB pool,
    one 20-token prompt, 62 MiB resident, one huge page per layer; 4 KiB pages: what the slots touch)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    same_size_int = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[torch.empty((), dtype=dtype).element_size()]
    cache = torch.from_numpy(np.zeros(shape, dtype=same_size_int))
    cpu_ops.no_huge_pages(cache)
    return cache.view(dtype)



def recapture_cuda_graphs(engine) -> None:
    """Captured graphs hold the old tensors' addresses: capture them again over the new ones."""
    if engine.config.cuda_graphs and engine.runner.device.type == "cuda":
        engine.runner.enable_cuda_graphs(min(engine.config.max_num_seqs, 512), engine.max_model_len)
