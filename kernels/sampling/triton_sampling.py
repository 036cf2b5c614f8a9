"""Triton: a Gumbel-max sampler for greedy and plain-temperature rows, and the greedy argmax of a few
vocabulary-wide rows split across programs (:func:`argmax`); see ``reference.py``."""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from ..triton_utils import next_power_of_2
from . import reference


@triton.jit
def _gumbel_max_sample_kernel(
    best_score_ptr, best_index_ptr, logits_ptr, temperatures_ptr, seed_ptr,
    num_rows, vocab_size, logits_stride_row, split_size, num_splits, greedy_temperature,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Best of ``logits / T + Gumbel noise`` over one vocabulary split of BLOCK_R rows.

    argmax over the whole vocabulary of that score is a draw from softmax(logits / T) (the
    Gumbel-max trick), found in one streaming pass with no softmax, sort or cumsum. Greedy rows
    add no noise. Splitting the vocabulary gives a small batch enough programs to fill the GPU.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(1)
    is_real_row = rows < num_rows
    rows = rows.to(tl.int64)
    temperatures = tl.load(temperatures_ptr + rows, mask=is_real_row, other=1.0).to(tl.float32)
    is_greedy = temperatures < greedy_temperature
    inverse_temperatures = 1.0 / tl.where(is_greedy, 1.0, temperatures)
    seed = tl.load(seed_ptr)

    # Each lane keeps its own best; strict '>' keeps the lowest index among equal scores.
    best_score = tl.full([BLOCK_R, BLOCK_V], float("-inf"), dtype=tl.float32)
    best_index = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.int32)
    split_start = split * split_size
    split_end = tl.minimum(split_start + split_size, vocab_size)
    for first in range(split_start, split_end, BLOCK_V):
        cols = first + tl.arange(0, BLOCK_V)
        mask = is_real_row[:, None] & (cols < split_end)[None, :]
        logits = tl.load(logits_ptr + rows[:, None] * logits_stride_row + cols[None, :], mask=mask,
                         other=float("-inf"))
        uniform = tl.rand(seed, rows[:, None] * vocab_size + cols[None, :])
        gumbel = -tl.log(-tl.log(uniform))
        score = logits.to(tl.float32) * inverse_temperatures[:, None] + tl.where(is_greedy[:, None], 0.0, gumbel)
        score = tl.where(mask, score, float("-inf"))
        is_better = score > best_score
        best_score = tl.where(is_better, score, best_score)
        best_index = tl.where(is_better, cols[None, :], best_index)
    top = tl.max(best_score, 1)
    index = tl.min(tl.where(best_score == top[:, None], best_index, vocab_size), 1)
    # A split of all -inf logits has no best lane; answer its first index, as torch.argmax would.
    index = tl.where(index == vocab_size, split_start, index)
    out = rows * num_splits + split
    tl.store(best_score_ptr + out, top, mask=is_real_row)
    tl.store(best_index_ptr + out, index.to(tl.int64), mask=is_real_row)


# Enough vocabulary splits that a decode batch's sampling has about this many programs.
SAMPLER_TARGET_PROGRAMS = 1024


def sample_from_logits(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    generator: torch.Generator | None = None,
    min_ps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row; the semantics of ``reference.sample_from_logits``, but a fused
    Gumbel-max kernel draws greedy and plain-temperature rows.

    Only rows with top-k, top-p or min-p go through the torch path (``torch.topk``, then top-p
    within the top k). The kernel's noise is Triton's Philox stream, seeded from ``generator``, so
    draws are reproducible for a given generator state but differ from the reference's draws.
    Deciding which rows need the torch path reads one flag on the host.
    """
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    needs_filtering = reference.rows_needing_filtering(temperatures, top_ks, top_ps, vocab_size, min_ps)
    num_filtered = int(needs_filtering.sum())
    if num_filtered == num_rows:
        return reference.sample_from_logits(logits, temperatures, top_ks, top_ps, generator, min_ps)
    tokens = _gumbel_max_sample(logits, temperatures, generator)
    if num_filtered:
        rows = needs_filtering.nonzero().squeeze(1)
        tokens[rows] = reference.sample_from_logits(
            logits[rows], temperatures[rows], top_ks[rows], top_ps[rows], generator,
            None if min_ps is None else min_ps[rows],
        )
    return tokens


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, *, top_ks=None, top_ps=None, min_ps=None,
                num_candidates=None, noise=None, generator=None) -> torch.Tensor:
    """As ``reference.sample_rows``; rows with temperature alone and no caller noise are drawn by
    the fused Gumbel-max kernel (one pass over the logits, nothing read back), the rest by the
    reference."""
    if noise is None and num_candidates is None and min_ps is None and logits.shape[0]:
        return _gumbel_max_sample(logits, temperatures, generator)
    return reference.sample_rows(logits, temperatures, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps,
                                 num_candidates=num_candidates, noise=noise, generator=generator)


def _gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, generator) -> torch.Tensor:
    num_rows, vocab_size = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # The seed stays on the device: no host sync, and the launch can be captured in a CUDA graph.
    seed_device = generator.device if generator is not None else logits.device
    seed = torch.randint(2**31 - 1, (1,), generator=generator, device=seed_device).to(logits.device)
    # Tiles of about 4096 logits: a slice of one row, or many whole rows of a tiny vocabulary.
    block_v = min(4096, next_power_of_2(vocab_size))
    block_r = min(4096 // block_v, next_power_of_2(num_rows))
    num_row_blocks = triton.cdiv(num_rows, block_r)
    num_splits = max(1, min(triton.cdiv(vocab_size, block_v), SAMPLER_TARGET_PROGRAMS // num_row_blocks))
    split_size = triton.cdiv(triton.cdiv(vocab_size, num_splits), block_v) * block_v
    num_splits = triton.cdiv(vocab_size, split_size)
    best_score = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(num_rows, num_splits, dtype=torch.int64, device=logits.device)
    _gumbel_max_sample_kernel[(num_row_blocks, num_splits)](
        best_score, best_index, logits, temperatures, seed,
        num_rows, vocab_size, logits.stride(0), split_size, num_splits, reference.GREEDY_TEMPERATURE,
        BLOCK_R=block_r, BLOCK_V=block_v, num_warps=8,
    )
    # torch.argmax takes the first of equal maxima: the lowest split, whose index is the lowest.
    best_split = best_score.argmax(dim=1, keepdim=True)
    return best_index.gather(1, best_split).squeeze(1)


@triton.jit
def _argmax_partial_kernel(best_value_ptr, best_index_ptr, first_nan_ptr, x_ptr, vocab_size, x_stride_row,
                           split_size, num_splits, BLOCK_V: tl.constexpr):
    """One split of one row: its largest value, the first index holding it, and its first NaN
    (``vocab_size`` when none)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * split_size
    end = tl.minimum(start + split_size, vocab_size)
    best = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    best_index = tl.full([BLOCK_V], vocab_size, dtype=tl.int32)
    first_nan = tl.full([BLOCK_V], vocab_size, dtype=tl.int32)
    for first in range(start, end, BLOCK_V):
        cols = first + tl.arange(0, BLOCK_V)
        mask = cols < end
        values = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        is_nan = values != values
        first_nan = tl.minimum(first_nan, tl.where(is_nan & mask, cols, vocab_size))
        # Strict '>' keeps each lane's first index; '>= -inf' lets an all -inf split answer its first index.
        is_better = mask & ~is_nan & ((values > best) | ((values == best) & (cols < best_index)))
        best = tl.where(is_better, values, best)
        best_index = tl.where(is_better, cols, best_index)
    top = tl.max(best, 0)
    out = row * num_splits + split
    tl.store(best_value_ptr + out, top)
    tl.store(best_index_ptr + out, tl.min(tl.where(best == top, best_index, vocab_size), 0))
    tl.store(first_nan_ptr + out, tl.min(first_nan, 0))


@triton.jit
def _argmax_final_kernel(out_ptr, best_value_ptr, best_index_ptr, first_nan_ptr, vocab_size, num_splits,
                         BLOCK_S: tl.constexpr):
    """A row's answer from its splits: its first NaN if it has one, else the first index of its maximum."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    mask = splits < num_splits
    values = tl.load(best_value_ptr + row * num_splits + splits, mask=mask, other=float("-inf"))
    indices = tl.load(best_index_ptr + row * num_splits + splits, mask=mask, other=vocab_size)
    nans = tl.load(first_nan_ptr + row * num_splits + splits, mask=mask, other=vocab_size)
    top = tl.max(values, 0)
    answer = tl.min(tl.where(values == top, indices, vocab_size), 0)
    first_nan = tl.min(nans, 0)
    answer = tl.where(first_nan < vocab_size, first_nan, answer)
    tl.store(out_ptr + row, tl.where(answer < vocab_size, answer, 0).to(tl.int64))


# torch's argmax of a row runs on one CTA when the row has fewer than 256 values for each of its 512
# threads (Reduce.cuh's split rule): Llama-3's 128,256-token vocabulary took 27-37 µs there on the
# H200 (round 1, 2026-12-02), Qwen3's 151,936, split across CTAs, 9 µs. Rows of these widths take
# the two-kernel argmax below; other widths keep torch's.
SPLIT_ARGMAX_WIDTHS = (32768, 512 * 256)
SPLIT_ARGMAX_MAX_ROWS = 16


def argmax(x: torch.Tensor) -> torch.Tensor:
    """As ``reference.argmax`` (the first maximum of each row; NaN counts as the largest): for a few
    rows as wide as a vocabulary but under torch's one-CTA limit, split across programs."""
    global _split_argmax_error
    rows, width = x.shape
    low, high = SPLIT_ARGMAX_WIDTHS
    if (_split_argmax_error is not None or not (0 < rows <= SPLIT_ARGMAX_MAX_ROWS and low <= width < high)
            or x.stride(-1) != 1):
        return reference.argmax(x)
    try:
        return _split_argmax(x)
    except Exception as error:  # noqa: BLE001  (a kernel that fails to build must not fail the step: torch's answer)
        _split_argmax_error = error
        logging.getLogger(__name__).warning("split argmax unavailable (%s: %s); torch.argmax from now on",
                                            type(error).__name__, error)
        return reference.argmax(x)


_split_argmax_error: Exception | None = None


def _split_argmax(x: torch.Tensor) -> torch.Tensor:
    rows, width = x.shape
    block_v = 2048
    num_splits = 64
    split_size = triton.cdiv(triton.cdiv(width, num_splits), block_v) * block_v
    num_splits = triton.cdiv(width, split_size)
    best_value = torch.empty(rows, num_splits, dtype=torch.float32, device=x.device)
    best_index = torch.empty(rows, num_splits, dtype=torch.int32, device=x.device)
    first_nan = torch.empty(rows, num_splits, dtype=torch.int32, device=x.device)
    _argmax_partial_kernel[(rows, num_splits)](best_value, best_index, first_nan, x, width, x.stride(0), split_size,
                                               num_splits, BLOCK_V=block_v, num_warps=4)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_final_kernel[(rows,)](out, best_value, best_index, first_nan, width, num_splits,
                                  BLOCK_S=next_power_of_2(num_splits), num_warps=1)
    return out
