"""Triton batched LoRA over a step's :class:`~.plan.LoRAPlan`: one shrink and one expand launch
per layer-projection, for every adapter and every slice of a fused layer at once.

* **shrink**: one program per (tile, rank block, K split): a tile's tokens share one slot, so
  ``x[tokens] @ A[slot].T`` is one tensor-core dot per K block, and each adapter's A is read once
  per tile, not once per token. Decode steps have few tiles, so K is split to fill the GPU; each
  split writes its own float32 partial (no atomics: the sum, done by the expand, is deterministic).
* **expand**: one program per (tile, group of column blocks): ``y[tokens] += s[tokens] @ B[slot]``,
  the tile's rank-space rows summed over the splits once for all its column blocks. A fused
  layer's slices (q, k, v; gate, up) keep their own rank blocks, and B is zero outside a slice's
  columns, so a column block reads only the ranks of the slices it overlaps (one slice, where the
  block does not straddle a boundary): fused ``qkv_proj`` costs what its three parts would.

* **expand + SwiGLU** (a gated MLP's ``gate_up_proj``): ``silu(g + s_g @ B_g) * (u + s_u @ B_u)`` for
  every token, the update added on the way into the activation, so the projection's output is read
  once and never written back (the in-place expand's read and write of ``[T, 2I]`` were most of a
  LoRA step's extra traffic). Base tokens' tiles (the plan's slot ``-2``) take the activation alone.

Sizes and strides are specialized (Triton's divisibility by 16): a mask ``cols < N`` with an unspecialized
``N`` cannot be proven constant over 8 lanes, which turned every load and store of ``y`` into 2-byte
accesses (sm_90 PTX: 112 ``ld.global.b16`` per thread against 6 ``ld.global.v4.b32``); the H200 ran the
expands at 0.5-0.9 TB/s that way.

Base-model tokens are in no tile of the shrink and expand: their rows of ``y`` are never loaded or
stored, so they stay bit-identical to the base projection. Tiles with slot ``-1`` (a graph's grid is
sized for its padded batch) exit at once.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..triton_utils import next_power_of_2
from .plan import LoRAPlan, block_m_for, max_tiles_for, max_tiles_with_base_for

# Launch shapes, from an H200 sweep at Llama-3-8B shapes (benchmarks/lora_kernels.py --sweep): decode-sized
# kernels are latency-bound, so short K loops (many splits) and many expand programs win there.
_TARGET_PROGRAMS = 264        # two per H200 SM: what split-K aims for on decode-sized steps
_MAX_SPLITS = 32
_MIN_K_PER_SPLIT = 128
_TARGET_EXPAND_PROGRAMS = 4096  # decode-sized steps: at most this many expand programs (~31 per SM), each of
                                # its tile's column blocks in turn; enough that a step's usual widths take one
                                # block per program (its loads then wait on nothing but the tile's)
NUM_TICKETS = 8192             # (tile, rank block) counters of split K, at the end of the scratch
_PREFILL_BLOCK_M = 64          # prefill-sized tiles: no K split, a column block per expand program (as SGMV)
_MAX_ONE_RANK_BLOCK = 4096     # tile rows x ranks kept in registers, summed once per tile (else per column block)
ONE_TOKEN_STEPS = True         # one-token steps (batch-1 decode) skip the sorted-token load (benchmarks A/B it)
# Programmatic dependent launch of the expands, as the batch-1 GEMVs' (kernels/gemv): the same pattern (let the
# next kernel start, read what no kernel of the step writes, then wait), so a one-row LoRA step keeps the GEMVs'
# overlap across its expands. H200, 2026-12-02 round 1, Llama-3-8B shape with 8 layers, batch-1 decode with a
# rank-16 adapter on all 7 targets: 15.5 µs a layer over the engine without LoRA against 19.9 with plain launches,
# the 129 greedy tokens equal (`python -m hearth_llm.benchmarks.lora --bs1-only --pdl-ab --num-layers 8`).
# benchmarks/lora.py --no-pdl turns it off.
USE_PDL = True


@triton.jit
def _tile_tokens(tiles_ptr, tokens_ptr, BLOCK_M: tl.constexpr, ONE_TOKEN: tl.constexpr = False):
    """This program's tile: its slot (-1: nothing to do), its token indices and which are real.
    ``ONE_TOKEN``: a one-token step (batch-1 decode; one tile, the token is row 0), so nothing waits on
    the sorted-token load: the slot's is the only load before the data's (a launch-bound kernel saves a
    dependent global-memory round trip)."""
    rows = tl.arange(0, BLOCK_M)
    if ONE_TOKEN:
        slot = tl.load(tiles_ptr)
        is_row = rows < 1
        tokens = tl.zeros([BLOCK_M], dtype=tl.int64)
    else:
        tile = tl.program_id(0)
        slot = tl.load(tiles_ptr + tile * 3)
        start = tl.load(tiles_ptr + tile * 3 + 1)
        count = tl.load(tiles_ptr + tile * 3 + 2)
        is_row = rows < count
        tokens = tl.load(tokens_ptr + tl.maximum(start, 0) + rows, mask=is_row, other=0).to(tl.int64)
    return slot, tokens, is_row


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, tiles_ptr, tokens_ptr, sum_ptr, part_ptr, tickets_ptr, K, R, K_PER_SPLIT, stride_xt,
                   stride_as, stride_ar, stride_ps, stride_pt, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    slot, tokens, is_row = _tile_tokens(tiles_ptr, tokens_ptr, BLOCK_M)
    if slot >= 0:
        ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        is_rank = ranks < R
        split = tl.program_id(2)
        k_begin = split * K_PER_SPLIT
        k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
        ks = tl.arange(0, BLOCK_K)
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k_start in range(k_begin, k_end, BLOCK_K):
            is_k = k_start + ks < k_end
            x = tl.load(x_ptr + tokens[:, None] * stride_xt + (k_start + ks)[None, :],
                        mask=is_row[:, None] & is_k[None, :], other=0.0)
            a = tl.load(a_base + ranks[None, :] * stride_ar + (k_start + ks)[:, None],
                        mask=is_rank[None, :] & is_k[:, None], other=0.0)
            if DOT_IN_FP32:
                acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, a, acc)
        offsets = tokens[:, None] * stride_pt + ranks[None, :]
        mask = is_row[:, None] & is_rank[None, :]
        if NUM_SPLITS == 1:
            tl.store(sum_ptr + offsets, acc, mask=mask)
        else:
            # Each split leaves its partial; the last of a (tile, rank block) to finish sums them in split
            # order (deterministic) into sum_ptr, so the expand reads one row per token, once.
            tl.store(part_ptr + split * stride_ps + offsets, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the ticket is taken
            ticket_ptr = tickets_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == NUM_SPLITS - 1:
                total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for other in tl.static_range(NUM_SPLITS):  # .cg: from L2, where the other SMs wrote
                    total += tl.load(part_ptr + other * stride_ps + offsets, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(sum_ptr + offsets, total, mask=mask)
                tl.atomic_xchg(ticket_ptr, 0)  # ready for the next launch


@triton.jit
def _rank_block(part_ptr, slice_starts_ptr, tokens, is_row, r_start, R, stride_ps, stride_pt,
                NUM_SPLITS: tl.constexpr, SLICE_RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Ranks ``r_start + [0, BLOCK_R)`` of the tile's tokens, summed over the K splits, and the
    column range of the slice each rank belongs to."""
    ranks = r_start + tl.arange(0, BLOCK_R)
    is_rank = ranks < R
    s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in tl.static_range(NUM_SPLITS):  # unrolled: the loads are all in flight at once
        s += tl.load(part_ptr + split * stride_ps + tokens[:, None] * stride_pt + ranks[None, :],
                     mask=is_row[:, None] & is_rank[None, :], other=0.0)
    piece = ranks // SLICE_RANK
    piece_start = tl.load(slice_starts_ptr + piece, mask=is_rank, other=0)
    piece_end = tl.load(slice_starts_ptr + piece + 1, mask=is_rank, other=0)
    return ranks, s, piece_start, piece_end


@triton.jit
def _b_block(b_base, stride_br, ranks, is_rank, piece_start, piece_end, cols, is_col, col_start,
             BLOCK_N: tl.constexpr):
    """``B[ranks, cols]``, only the ranks whose slice overlaps these columns (B is zero elsewhere, so the
    others would add exactly nothing)."""
    is_needed = is_rank & (piece_start < col_start + BLOCK_N) & (piece_end > col_start)
    return tl.load(b_base + ranks[:, None] * stride_br + cols[None, :], mask=is_needed[:, None] & is_col[None, :],
                   other=0.0)


@triton.jit
def _dot_b(acc, s, b, DOT_IN_FP32: tl.constexpr):
    """``acc + s @ b``: float32 ranks by a block of B."""
    if DOT_IN_FP32:
        return tl.dot(s, b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(s.to(b.dtype), b, acc)


@triton.jit
def _expand_kernel(part_ptr, b_ptr, tiles_ptr, tokens_ptr, y_ptr, slice_starts_ptr, N, R,
                   stride_ps, stride_pt, stride_pslot, stride_bs, stride_br, stride_yt, NUM_SPLITS: tl.constexpr,
                   SLICE_RANK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ONE_RANK_BLOCK: tl.constexpr,
                   DOT_IN_FP32: tl.constexpr, ONE_TOKEN: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    slot, tokens, is_row = _tile_tokens(tiles_ptr, tokens_ptr, BLOCK_M, ONE_TOKEN)  # the plan: not a kernel's output
    b_base = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs
    num_col_programs = tl.num_programs(1)
    if ONE_RANK_BLOCK:
        # Before the wait (with PDL: while the kernel before still runs) what no kernel of the step writes:
        # the slice bounds and the first column block of B. Every program waits, even one with nothing to
        # do, so this kernel never ends before the one it follows (the kernel after it relies on that).
        ranks = tl.arange(0, BLOCK_R)
        is_rank = ranks < R * (slot >= 0).to(tl.int32)  # (no ranks: nothing to load for an unused tile)
        piece = ranks // SLICE_RANK
        piece_start = tl.load(slice_starts_ptr + piece, mask=is_rank, other=0)
        piece_end = tl.load(slice_starts_ptr + piece + 1, mask=is_rank, other=0)
        col_start = tl.program_id(1) * BLOCK_N
        cols = col_start + tl.arange(0, BLOCK_N)
        b = _b_block(b_base, stride_br, ranks, is_rank, piece_start, piece_end, cols, cols < N, col_start, BLOCK_N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the rank-space rows and y are the previous kernel's outputs
    if slot >= 0:
        slot_part_ptr = part_ptr + slot * stride_pslot  # 0, or where this slot's ranks sit in a row of every slot's
        if ONE_RANK_BLOCK:  # the usual case: the tile's ranks summed once, for every column block
            s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in tl.static_range(NUM_SPLITS):  # unrolled: the loads are all in flight at once
                s += tl.load(slot_part_ptr + split * stride_ps + tokens[:, None] * stride_pt + ranks[None, :],
                             mask=is_row[:, None] & is_rank[None, :], other=0.0)
        # Each program takes every num_programs(1)-th column block: decode steps have few tiles, and
        # the rank-space rows are loaded once for all of them.
        for col_block in range(tl.program_id(1), tl.cdiv(N, BLOCK_N), num_col_programs):
            col_start = col_block * BLOCK_N
            cols = col_start + tl.arange(0, BLOCK_N)
            is_col = cols < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if ONE_RANK_BLOCK:
                next_start = col_start + num_col_programs * BLOCK_N  # (past N, as usual at decode: loads nothing)
                next_cols = next_start + tl.arange(0, BLOCK_N)
                next_b = _b_block(b_base, stride_br, ranks, is_rank, piece_start, piece_end, next_cols,
                                  next_cols < N, next_start, BLOCK_N)
                acc = _dot_b(acc, s, b, DOT_IN_FP32)
                b = next_b
            else:
                for r_start in range(0, R, BLOCK_R):
                    block_ranks, block_s, block_start, block_end = _rank_block(
                        slot_part_ptr, slice_starts_ptr, tokens, is_row, r_start, R, stride_ps, stride_pt,
                        NUM_SPLITS, SLICE_RANK, BLOCK_M, BLOCK_R)
                    block_b = _b_block(b_base, stride_br, block_ranks, block_ranks < R, block_start, block_end,
                                       cols, is_col, col_start, BLOCK_N)
                    acc = _dot_b(acc, block_s, block_b, DOT_IN_FP32)
            mask = is_row[:, None] & is_col[None, :]
            y_ptrs = y_ptr + tokens[:, None] * stride_yt + cols[None, :]
            y = tl.load(y_ptrs, mask=mask, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


@triton.jit
def _expand_silu_and_mul_kernel(y_ptr, shrunk_ptr, b_ptr, tiles_ptr, tokens_ptr, out_ptr, I, stride_yt, stride_st,
                                stride_pslot, stride_bs, stride_br, stride_ot, RANK: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                                DOT_IN_FP32: tl.constexpr, ONE_TOKEN: tl.constexpr = False,
                                USE_PDL: tl.constexpr = False):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    slot, tokens, is_row = _tile_tokens(tiles_ptr, tokens_ptr, BLOCK_M, ONE_TOKEN)
    # Base tiles (slot -2) run the same code with every rank masked off: the dots add exact zeros,
    # so their rows are the plain activation's, bit for bit.
    own_slot = tl.maximum(slot, 0).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    is_rank = ranks < RANK * (slot >= 0).to(tl.int32)
    b_gate_rows = b_ptr + own_slot * stride_bs + ranks[:, None] * stride_br
    b_up_rows = b_gate_rows + RANK * stride_br + I
    num_col_programs = tl.num_programs(1)
    # Before the wait (PDL): the first column block of B, which no kernel of the step writes; every program
    # waits (see _expand_kernel).
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_mask = is_rank[:, None] & (cols < I)[None, :]
    b_gate = tl.load(b_gate_rows + cols[None, :], mask=b_mask, other=0.0)
    b_up = tl.load(b_up_rows + cols[None, :], mask=b_mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if slot != -1:
        s_rows = shrunk_ptr + own_slot * stride_pslot + tokens[:, None] * stride_st
        s_mask = is_row[:, None] & is_rank[None, :]
        s_gate = tl.load(s_rows + ranks[None, :], mask=s_mask, other=0.0)
        s_up = tl.load(s_rows + RANK + ranks[None, :], mask=s_mask, other=0.0)
        if DOT_IN_FP32:
            s_gate, s_up = s_gate.to(tl.float32), s_up.to(tl.float32)
        else:
            s_gate, s_up = s_gate.to(b_ptr.dtype.element_ty), s_up.to(b_ptr.dtype.element_ty)
        y_rows = y_ptr + tokens[:, None] * stride_yt
        out_rows = out_ptr + tokens[:, None] * stride_ot
        for col_block in range(tl.program_id(1), tl.cdiv(I, BLOCK_N), num_col_programs):
            cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
            is_col = cols < I
            mask = is_row[:, None] & is_col[None, :]
            gate = tl.load(y_rows + cols[None, :], mask=mask, other=0.0)
            up = tl.load(y_rows + I + cols[None, :], mask=mask, other=0.0)
            next_cols = cols + num_col_programs * BLOCK_N  # (past I, as usual at decode: loads nothing)
            next_mask = is_rank[:, None] & (next_cols < I)[None, :]
            next_b_gate = tl.load(b_gate_rows + next_cols[None, :], mask=next_mask, other=0.0)
            next_b_up = tl.load(b_up_rows + next_cols[None, :], mask=next_mask, other=0.0)
            if DOT_IN_FP32:
                gate = tl.dot(s_gate, b_gate.to(tl.float32), gate.to(tl.float32), input_precision="ieee")
                up = tl.dot(s_up, b_up.to(tl.float32), up.to(tl.float32), input_precision="ieee")
            else:  # rounded to y's dtype as the in-place expand stores it, then the activation as silu_and_mul's
                gate = tl.dot(s_gate, b_gate, gate.to(tl.float32)).to(y_ptr.dtype.element_ty).to(tl.float32)
                up = tl.dot(s_up, b_up, up.to(tl.float32)).to(y_ptr.dtype.element_ty).to(tl.float32)
            b_gate, b_up = next_b_gate, next_b_up
            out = gate * tl.sigmoid(gate) * up
            tl.store(out_rows + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def num_splits_for(num_tokens: int, in_features: int, rank: int, num_slots: int, scratch_rows: int) -> int:
    """K splits of the shrink: enough programs to fill the GPU when a step has few tiles (decode),
    each split at least ``_MIN_K_PER_SPLIT`` wide, and the partials within the scratch. A function
    of the shapes only, so a captured graph and its replays agree."""
    if block_m_for(num_tokens) >= _PREFILL_BLOCK_M:  # tiles enough (and every expand program would re-sum)
        return 1
    programs = max_tiles_for(num_tokens, num_slots) * triton.cdiv(rank, _block_r(rank))
    if programs > NUM_TICKETS:
        return 1
    splits = 1
    while (splits < _MAX_SPLITS and programs * splits < _TARGET_PROGRAMS
           and in_features // (2 * splits) >= _MIN_K_PER_SPLIT and (2 * splits + 1) * num_tokens <= scratch_rows):
        splits *= 2
    return splits


def _pdl(tensor: torch.Tensor) -> dict:
    """Launch arguments for programmatic dependent launch (:data:`USE_PDL`, Hopper and newer): the expand
    lets the next kernel start early and reads its tile's plan before waiting for the kernel before it."""
    if not (USE_PDL and tensor.is_cuda and _has_pdl(tensor.device.index or 0)):
        return {}
    return {"USE_PDL": True, "launch_pdl": True}


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _warps_for(block_m: int) -> int:
    """Warps of an expand program: 8 from 32-row tiles on (sm_90 ptxas, bf16, 128 columns: the SwiGLU's two
    accumulators took 255 registers and spilled at 64 rows x 4 warps, 137 with 8; 32 rows, 128 against 64)."""
    return 4 if block_m < 32 else 8


def _block_r(rank: int) -> int:
    return min(max(16, next_power_of_2(rank)), 64)


def add_lora_planned(y: torch.Tensor, x: torch.Tensor, plan: LoRAPlan, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     slice_starts: torch.Tensor, slice_rank: int, scratch: torch.Tensor) -> torch.Tensor:
    """``y[t] += (x[t] @ lora_a[s].T) @ lora_b[s]`` for every token ``t`` the plan gives slot ``s``.

    ``lora_a`` ``[S, P * slice_rank, K]`` and ``lora_b`` ``[S, P * slice_rank, N]`` hold ``P`` slices;
    slice ``p`` covers columns ``slice_starts[p] : slice_starts[p + 1]`` (``slice_starts``: int32 on
    the device, ``P + 1`` long) and B is zero outside them. ``scratch``: float32, zeros when first
    given (its last :data:`NUM_TICKETS` elements are the K splits' tickets, which every launch leaves at
    zero), large enough for the split partials it has room for (:func:`num_splits_for`), and at least
    ``(NUM_TICKETS + num_tokens * P * slice_rank)`` elements. ``y`` and ``x`` need unit stride along
    their rows; ``lora_a``/``lora_b`` must be contiguous. Returns ``y``.
    """
    if x.shape[0] == 0:
        return y
    return expand_planned(y, shrink_planned(x, plan, lora_a, scratch), plan, lora_b, slice_starts, slice_rank)


def shrink_planned(x: torch.Tensor, plan: LoRAPlan, lora_a: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The first half of :func:`add_lora_planned`: ``x[t] @ lora_a[s].T`` for the plan's tokens into a
    float32 ``[T, R]`` view of ``scratch`` (other rows undefined), in one launch. Reads only ``x``,
    so it may run beside the base projection (another stream)."""
    num_tokens, in_features = x.shape
    num_slots, rank, _ = lora_a.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    block_m = block_m_for(num_tokens)
    num_tiles = max_tiles_for(num_tokens, num_slots)
    block_r = _block_r(rank)
    tickets = scratch[-NUM_TICKETS:].view(torch.int32)
    num_splits = num_splits_for(num_tokens, in_features, rank, num_slots, (scratch.numel() - NUM_TICKETS) // rank)
    k_per_split = triton.cdiv(triton.cdiv(in_features, num_splits), 64) * 64
    rank_rows = scratch[:(num_splits + 1) * num_tokens * rank].view(num_splits + 1, num_tokens, rank)
    shrunk, partials = rank_rows[0], rank_rows[1:]
    dot_in_fp32 = x.dtype == torch.float32
    _shrink_kernel[(num_tiles, triton.cdiv(rank, block_r), num_splits)](
        x, lora_a, plan.tiles, plan.sorted_tokens, shrunk, partials, tickets, in_features, rank, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), rank_rows.stride(0), rank_rows.stride(1),
        NUM_SPLITS=num_splits, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=32 if dot_in_fp32 else 64,
        DOT_IN_FP32=dot_in_fp32)
    return shrunk


def expand_planned(y: torch.Tensor, shrunk: torch.Tensor, plan: LoRAPlan, lora_b: torch.Tensor,
                   slice_starts: torch.Tensor, slice_rank: int, slot_stride: int = 0) -> torch.Tensor:
    """The second half: ``y[t] += shrunk[t] @ lora_b[s]`` for the plan's tokens, in one launch.

    ``slot_stride`` 0: ``shrunk`` ``[T, R]`` holds each token's own slot's ranks. Else ``shrunk`` is
    the first ``R`` columns of rows holding every slot's ranks, slot ``s``'s ``slot_stride * s``
    columns further on (the base GEMM's extra output columns when A is stacked under its weight).
    Either may be a strided view (unit stride along a row), as may ``y``."""
    num_tokens = shrunk.shape[0]
    num_slots, rank, out_features = lora_b.shape
    block_m = block_m_for(num_tokens)
    num_tiles = max_tiles_for(num_tokens, num_slots)
    dot_in_fp32 = y.dtype == torch.float32
    block_n = 64 if dot_in_fp32 else 128
    num_col_blocks = triton.cdiv(out_features, block_n)
    if block_m < _PREFILL_BLOCK_M:  # few tiles: deal each program several column blocks
        num_col_blocks = min(num_col_blocks, triton.cdiv(_TARGET_EXPAND_PROGRAMS, num_tiles))
    one_rank_block = block_m * next_power_of_2(rank) <= _MAX_ONE_RANK_BLOCK
    one_token = num_tokens == 1 and ONE_TOKEN_STEPS
    _expand_kernel[(1 if one_token else num_tiles, num_col_blocks)](
        shrunk, lora_b, plan.tiles, plan.sorted_tokens, y, slice_starts, out_features, rank,
        0, shrunk.stride(0), slot_stride, lora_b.stride(0), lora_b.stride(1), y.stride(0),
        NUM_SPLITS=1, SLICE_RANK=slice_rank, BLOCK_M=block_m,
        BLOCK_R=max(16, next_power_of_2(rank)) if one_rank_block else 64, BLOCK_N=block_n,
        ONE_RANK_BLOCK=one_rank_block, DOT_IN_FP32=dot_in_fp32, ONE_TOKEN=one_token, num_warps=_warps_for(block_m),
        **_pdl(y))
    return y


def expand_silu_and_mul_planned(y: torch.Tensor, shrunk: torch.Tensor, plan: LoRAPlan, lora_b: torch.Tensor,
                                slice_rank: int, slot_stride: int) -> torch.Tensor:
    """``silu(g) * u`` of ``[g | u] = y[t] + shrunk[t] @ lora_b[s]`` for every token of the plan, in one
    launch; returns the new ``[T, I]`` tensor (rows of no tile, a graph's padding, are left undefined).

    ``y`` ``[T, 2I]``: a gated MLP's ``gate_up_proj`` output (unit stride along a row); ``lora_b``
    ``[S, 2 * slice_rank, 2I]``: ranks ``[0, slice_rank)`` the gate's (columns ``[0, I)``), the next
    ``slice_rank`` the up projection's (columns ``[I, 2I)``); ``shrunk``: the first columns of rows
    holding every slot's ranks, slot ``s``'s ``slot_stride * s`` columns on, as ``expand_planned``'s."""
    num_tokens, two_i = y.shape
    intermediate_size = two_i // 2
    num_slots = lora_b.shape[0]
    out = torch.empty(num_tokens, intermediate_size, dtype=y.dtype, device=y.device)
    if num_tokens == 0:
        return out
    block_m = block_m_for(num_tokens)
    num_tiles = max_tiles_with_base_for(num_tokens, num_slots)
    dot_in_fp32 = y.dtype == torch.float32
    block_n = 64 if dot_in_fp32 else 128
    num_col_blocks = triton.cdiv(intermediate_size, block_n)
    if block_m < _PREFILL_BLOCK_M:
        num_col_blocks = min(num_col_blocks, triton.cdiv(_TARGET_EXPAND_PROGRAMS, num_tiles))
    one_token = num_tokens == 1 and ONE_TOKEN_STEPS
    _expand_silu_and_mul_kernel[(1 if one_token else num_tiles, num_col_blocks)](
        y, shrunk, lora_b, plan.tiles, plan.sorted_tokens, out, intermediate_size, y.stride(0), shrunk.stride(0),
        slot_stride, lora_b.stride(0), lora_b.stride(1), out.stride(0), RANK=slice_rank, BLOCK_M=block_m,
        BLOCK_R=max(16, next_power_of_2(slice_rank)), BLOCK_N=block_n, DOT_IN_FP32=dot_in_fp32, ONE_TOKEN=one_token,
        num_warps=_warps_for(block_m), **_pdl(y))
    return out


def add_lora(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
             lora_b: torch.Tensor) -> torch.Tensor:
    """See :func:`hearth_llm.kernels.lora.add_lora`: plans from ``token_slots`` (one host read of
    them; the engine plans once per step instead) and treats the rank as one slice."""
    num_tokens = x.shape[0]
    num_slots, rank, _ = lora_a.shape
    if num_tokens == 0:
        return y
    plan = LoRAPlan(num_tokens, num_slots, x.device)
    plan.set_token_slots(token_slots)
    if not plan.has_adapters:
        return y
    slice_starts = torch.tensor([0, lora_b.shape[-1]], dtype=torch.int32, device=x.device)
    scratch = torch.zeros((_MAX_SPLITS + 1) * num_tokens * rank + NUM_TICKETS, dtype=torch.float32, device=x.device)
    return add_lora_planned(y, x, plan, lora_a.contiguous(), lora_b.contiguous(), slice_starts, rank, scratch)
