"""A step's LoRA work list: which tokens each adapter slot takes, in the tiles the kernels read.

Built once per step on the host from what the scheduler already knows (each sequence's slot and
its number of new tokens), copied to the device in one non-blocking transfer into buffers whose
addresses never change, so CUDA graphs captured with the LoRA path read each replay's plan.
Every layer-projection of the step reuses it: no per-layer sort, no host sync.

* ``sorted_tokens``: the indices of the tokens that have an adapter, grouped by slot (a
  sequence's tokens stay consecutive: prefill segments are contiguous rows of ``x``);
* ``tiles`` ``[max_tiles, 3]``: ``(slot, first index into sorted_tokens, count <= block_m)``;
  unused entries have slot ``-1``, and those programs exit at once. The base-model tokens follow
  the adapters' in ``sorted_tokens``, in tiles of slot :data:`BASE_SLOT` after the adapters'
  tiles: the shrink and expand skip them (their output rows are never loaded or stored), while a
  kernel that must produce every row (the LoRA SwiGLU, ``expand_silu_and_mul``) takes them too.

``block_m`` (tokens per tile) depends only on the step's token count, through thresholds that are
multiples of 16 (as every captured graph size above 8 is), so a graph captured at a padded size
and the plan of the real step always agree.

>>> plan = LoRAPlan(capacity=64, num_slots=2, device=torch.device("cpu"))
>>> plan.set_sequences([1, -1, 0], [3, 2, 1])
>>> plan.has_adapters, plan.sorted_tokens[:4].tolist()
(True, [5, 0, 1, 2])
>>> plan.tiles[:4].tolist()
[[0, 0, 1], [1, 1, 3], [-2, 4, 2], [-1, -1, -1]]
"""
from __future__ import annotations

import numpy as np
import torch

_BLOCK_M_BY_TOKENS = ((128, 16), (1024, 32))   # (at most this many tokens, tokens per tile); else 64
LARGEST_BLOCK_M = 64
SMALLEST_BLOCK_M = 16
BASE_SLOT = -2  # the slot of a tile of base-model tokens (-1: an unused tile)


def block_m_for(num_tokens: int) -> int:
    """Tokens per tile for a step (or a captured graph) of ``num_tokens`` tokens."""
    for most_tokens, block_m in _BLOCK_M_BY_TOKENS:
        if num_tokens <= most_tokens:
            return block_m
    return LARGEST_BLOCK_M


def max_tiles_for(num_tokens: int, num_slots: int) -> int:
    """The most tiles a step can need: each slot's last tile may be partly full."""
    return -(-num_tokens // block_m_for(num_tokens)) + min(num_slots, num_tokens)


def max_tiles_with_base_for(num_tokens: int, num_slots: int) -> int:
    """The most tiles, adapters' and base tokens' together (the base tokens' last tile may be partly full)."""
    return max_tiles_for(num_tokens, num_slots) + 1


class LoRAPlan:
    """See the module docstring. ``capacity``: the most tokens a step may have."""

    def __init__(self, capacity: int, num_slots: int, device: torch.device) -> None:
        self.capacity = capacity
        self.num_slots = num_slots
        self.device = device
        self.num_tile_rows = -(-capacity // SMALLEST_BLOCK_M) + num_slots + 1
        self._tile_numel = 3 * self.num_tile_rows
        self.buffer = torch.full((self._tile_numel + capacity,), -1, dtype=torch.int32, device=device)
        self.tiles = self.buffer[:self._tile_numel].view(self.num_tile_rows, 3)
        self.sorted_tokens = self.buffer[self._tile_numel:]
        self.num_tokens = 0
        self.block_m = SMALLEST_BLOCK_M
        self.has_adapters = False

    def set_sequences(self, slot_of_seq, num_tokens_of_seq) -> None:
        """This step: sequence ``i`` has ``num_tokens_of_seq[i]`` consecutive tokens, all on slot
        ``slot_of_seq[i]`` (``-1``: the base model)."""
        slots = np.asarray(slot_of_seq, dtype=np.int64).reshape(-1)
        counts = np.asarray(num_tokens_of_seq, dtype=np.int64).reshape(-1)
        num_tokens = int(counts.sum())
        if num_tokens > self.capacity:
            # Never a new buffer: captured CUDA graphs read this one. The runner sizes it for the
            # step's token budget, so this is a bug, and failing the step beats wrong adapters.
            raise RuntimeError(f"a step of {num_tokens} tokens exceeds the LoRA plan's capacity ({self.capacity})")
        self.num_tokens = num_tokens
        self.block_m = block_m_for(num_tokens)
        self.has_adapters = bool((slots >= 0).any())
        if self.has_adapters:
            self._upload(*_tiles(slots, counts, self.block_m))

    def set_token_slots(self, token_slots) -> None:
        """The same from one slot per token (runs of equal slots become segments)."""
        slots = np.asarray(torch.as_tensor(token_slots).cpu(), dtype=np.int64).reshape(-1)
        if len(slots) == 0:
            self.set_sequences([], [])
            return
        run_starts = np.flatnonzero(np.diff(slots, prepend=slots[0] - 1))
        self.set_sequences(slots[run_starts], np.diff(np.append(run_starts, len(slots))))

    def clear(self) -> None:
        """No adapters, and every tile unused (before capturing graphs: stale tiles could name
        tokens beyond the captured batch)."""
        self.tiles.fill_(-1)
        self.num_tokens, self.has_adapters = 0, False

    def _upload(self, tiles: np.ndarray, sorted_tokens: np.ndarray) -> None:
        # One transfer: every tile row (the unused ones as -1, so a graph's larger grid skips
        # them), then the sorted tokens. A fresh pinned buffer per step: the caching host
        # allocator keeps it until the copy has run, while the host may be a step ahead.
        host = torch.full((self._tile_numel + len(sorted_tokens),), -1, dtype=torch.int32,
                          pin_memory=self.device.type == "cuda")
        values = host.numpy()
        values[:tiles.size] = tiles.reshape(-1)
        values[self._tile_numel:] = sorted_tokens
        self.buffer[:len(host)].copy_(host, non_blocking=True)


def _tiles(slots: np.ndarray, counts: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tiles [n, 3], sorted_tokens)`` for sequences with these slots and token counts: the
    adapters' tokens grouped by slot, then the base tokens (slot :data:`BASE_SLOT`)."""
    first_token = np.concatenate(([0], np.cumsum(counts)[:-1]))
    last = np.iinfo(np.int64).max
    keys = np.where(slots >= 0, slots, last)  # the base tokens' group sorts last
    seqs = np.flatnonzero(counts > 0)
    seqs = seqs[np.argsort(keys[seqs], kind="stable")]
    lengths = counts[seqs]
    run_offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    sorted_tokens = np.repeat(first_token[seqs] - run_offsets, lengths) + np.arange(int(lengths.sum()))
    group_keys, first_seq = np.unique(keys[seqs], return_index=True)
    slot_ids = np.where(group_keys == last, BASE_SLOT, group_keys)
    tokens_per_slot = np.add.reduceat(lengths, first_seq)
    slot_start = run_offsets[first_seq]
    tiles_per_slot = -(-tokens_per_slot // block_m)
    tile_slot = np.repeat(slot_ids, tiles_per_slot)
    tile_index = np.arange(len(tile_slot)) - np.repeat(np.cumsum(tiles_per_slot) - tiles_per_slot, tiles_per_slot)
    tile_start = np.repeat(slot_start, tiles_per_slot) + tile_index * block_m
    tile_count = np.minimum(block_m, np.repeat(slot_start + tokens_per_slot, tiles_per_slot) - tile_start)
    return np.stack([tile_slot, tile_start, tile_count], axis=1), sorted_tokens
