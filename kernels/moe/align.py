"""Expert-sorted, block-aligned layout of a batch's (token, expert) pairs, for grouped GEMMs.

The ``T * top_k`` routing entries (entry ``i`` is token ``i // top_k``'s ``i % top_k``-th choice) are
grouped by expert, and each expert's group is padded to a multiple of ``block_m`` with the
sentinel ``T * top_k``. Every block of ``block_m`` consecutive slots then belongs to one expert,
so one GEMM program multiplies one block of rows by one expert's weights.

- ``sorted_entries`` ``[max_padded]`` int32: entry ids, expert by expert, padded with the sentinel;
  slots from ``num_padded`` on are unused.
- ``block_experts`` ``[max_padded // block_m]`` int32: the expert of each block below ``num_padded``.
- ``num_padded`` ``[1]`` int32: the padded length actually used.

Within an expert's group entries come in no particular order (the GPU kernel places them with
atomics); each GEMM row depends only on its own entry, so results do not depend on it.

Nothing here reads a routing result on the host, so the layout can be captured in a CUDA graph:
its sizes follow from ``T``, ``top_k`` and the number of experts alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# A batch of at most this many entries (decode: 256 tokens x top-8) is laid out by one program
# in one launch; larger batches use three kernels over many programs.
MAX_ENTRIES_ONE_PROGRAM = 4096
CHUNK = 1024


def max_padded_entries(num_entries: int, num_experts: int, block_m: int) -> int:
    """Slots the layout may need: every used expert rounds its group up to ``block_m``, and at most
    ``min(num_entries, num_experts)`` experts are used."""
    padded = num_entries + min(num_entries, num_experts) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The layout in plain torch (entries of an expert in batch order); the kernels' test oracle."""
    flat = topk_ids.reshape(-1).long()
    num_entries = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    max_padded = max_padded_entries(num_entries, num_experts, block_m)
    sorted_entries = torch.full((max_padded,), num_entries, dtype=torch.int32)
    block_experts = torch.zeros(max_padded // block_m, dtype=torch.int32)
    start = 0
    for expert in range(num_experts):
        entries = (flat == expert).nonzero().flatten()
        sorted_entries[start:start + entries.numel()] = entries.to(torch.int32)
        block_experts[start // block_m:(start + int(padded[expert])) // block_m] = expert
        start += int(padded[expert])
    return sorted_entries, block_experts, torch.tensor([start], dtype=torch.int32)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """``(sorted_entries, block_experts, num_padded)`` for ``topk_ids`` ``[T, top_k]`` (see the module doc).

    >>> sorted_entries, block_experts, num_padded = align_block_size(ids.cuda(), num_experts=8, block_m=16)
    """
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_entries = flat.numel()
    device = topk_ids.device
    max_padded = max_padded_entries(num_entries, num_experts, block_m)
    sorted_entries = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    # Per expert: entries counted, then the next free slot while entries are placed.
    cursors = torch.empty(num_experts, dtype=torch.int32, device=device)
    common = dict(BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=CHUNK)
    if num_entries <= MAX_ENTRIES_ONE_PROGRAM:
        counts = torch.empty(num_experts, dtype=torch.int32, device=device)  # zeroed by the kernel
        _align_one_program_kernel[(1,)](flat, sorted_entries, block_experts, num_padded, counts, cursors,
                                        num_entries, num_experts, **common, num_warps=8)
        return sorted_entries, block_experts, num_padded
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    num_chunks = triton.cdiv(num_entries, CHUNK)
    _count_kernel[(num_chunks,)](flat, counts, num_entries, CHUNK=CHUNK)
    _layout_kernel[(1,)](sorted_entries, block_experts, num_padded, counts, cursors, num_entries, num_experts,
                         **common)
    _place_kernel[(num_chunks,)](flat, sorted_entries, cursors, num_entries, CHUNK=CHUNK)
    return sorted_entries, block_experts, num_padded


@triton.jit
def _count_chunk(topk_ids_ptr, counts_ptr, start, num_entries, CHUNK: tl.constexpr):
    entries = start + tl.arange(0, CHUNK)
    is_entry = entries < num_entries
    experts = tl.load(topk_ids_ptr + entries, mask=is_entry, other=0)
    tl.atomic_add(counts_ptr + experts, tl.full([CHUNK], 1, tl.int32), mask=is_entry)


@triton.jit
def _place_chunk(topk_ids_ptr, sorted_entries_ptr, cursors_ptr, start, num_entries, CHUNK: tl.constexpr):
    entries = start + tl.arange(0, CHUNK)
    is_entry = entries < num_entries
    experts = tl.load(topk_ids_ptr + entries, mask=is_entry, other=0)
    slots = tl.atomic_add(cursors_ptr + experts, tl.full([CHUNK], 1, tl.int32), mask=is_entry)
    tl.store(sorted_entries_ptr + slots, entries.to(tl.int32), mask=is_entry)


@triton.jit
def _lay_out_experts(sorted_entries_ptr, block_experts_ptr, num_padded_ptr, counts_ptr, cursors_ptr,
                     num_entries, num_experts,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """From the counts: each expert's first slot (into ``cursors``), the expert of every block,
    the sentinel in each group's padding, and the padded total."""
    experts = tl.arange(0, BLOCK_E)
    is_expert = experts < num_experts
    # .cg: the counts were just added at L2 by atomics; do not read a stale L1 line.
    counts = tl.load(counts_ptr + experts, mask=is_expert, other=0, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(cursors_ptr + experts, starts, mask=is_expert)
    num_padded = tl.sum(padded, 0)
    tl.store(num_padded_ptr, num_padded)

    PAD_CHUNK: tl.constexpr = min(BLOCK_M, BLOCK_CHUNK)
    for first_pad in tl.static_range(0, BLOCK_M, PAD_CHUNK):
        pad_slots = (starts + counts)[:, None] + first_pad + tl.arange(0, PAD_CHUNK)[None, :]
        tl.store(sorted_entries_ptr + pad_slots, tl.full([BLOCK_E, PAD_CHUNK], 0, tl.int32) + num_entries,
                 mask=is_expert[:, None] & (pad_slots < ends[:, None]))

    # A block's expert is the number of groups that end at or before the block's first slot. A
    # [BLOCK_CHUNK, BLOCK_E] comparison at a time: larger tiles spill registers (a 1024-block tile
    # made this kernel 0.28 ms on an H200).
    for first_block in range(0, num_padded // BLOCK_M, BLOCK_CHUNK):
        blocks = first_block + tl.arange(0, BLOCK_CHUNK)
        owners = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(block_experts_ptr + blocks, owners, mask=blocks < num_padded // BLOCK_M)


@triton.jit(do_not_specialize=["num_entries"])
def _align_one_program_kernel(topk_ids_ptr, sorted_entries_ptr, block_experts_ptr, num_padded_ptr, counts_ptr,
                              cursors_ptr, num_entries, num_experts,
                              BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """The whole layout in one program: count, lay out, place; barriers order the phases."""
    experts = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + experts, tl.zeros([BLOCK_E], tl.int32), mask=experts < num_experts)
    tl.debug_barrier()
    for start in range(0, num_entries, CHUNK):
        _count_chunk(topk_ids_ptr, counts_ptr, start, num_entries, CHUNK)
    tl.debug_barrier()
    _lay_out_experts(sorted_entries_ptr, block_experts_ptr, num_padded_ptr, counts_ptr, cursors_ptr, num_entries,
                     num_experts, BLOCK_M, BLOCK_E, 4096 // BLOCK_E)
    tl.debug_barrier()
    for start in range(0, num_entries, CHUNK):
        _place_chunk(topk_ids_ptr, sorted_entries_ptr, cursors_ptr, start, num_entries, CHUNK)


@triton.jit(do_not_specialize=["num_entries"])
def _count_kernel(topk_ids_ptr, counts_ptr, num_entries, CHUNK: tl.constexpr):
    _count_chunk(topk_ids_ptr, counts_ptr, tl.program_id(0) * CHUNK, num_entries, CHUNK)


@triton.jit(do_not_specialize=["num_entries"])
def _layout_kernel(sorted_entries_ptr, block_experts_ptr, num_padded_ptr, counts_ptr, cursors_ptr, num_entries,
                   num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    _lay_out_experts(sorted_entries_ptr, block_experts_ptr, num_padded_ptr, counts_ptr, cursors_ptr, num_entries,
                     num_experts, BLOCK_M, BLOCK_E, 4096 // BLOCK_E)


@triton.jit(do_not_specialize=["num_entries"])
def _place_kernel(topk_ids_ptr, sorted_entries_ptr, cursors_ptr, num_entries, CHUNK: tl.constexpr):
    _place_chunk(topk_ids_ptr, sorted_entries_ptr, cursors_ptr, tl.program_id(0) * CHUNK, num_entries, CHUNK)
