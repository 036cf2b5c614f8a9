"""FlashAttention-2 for the prefill rows of a step: torch's bundled varlen forward
(``aten._flash_attention_forward``, CUDA only) over keys and values gathered out of the paged cache.

On an H200 (Llama-3-8B shape, round 1 of 2026-12-02, per layer call in CUDA graphs, gathering
included) it ran two fresh 8k prompts at 335 TFLOP/s against 282 for our Triton prefill kernel
(1.19x), two 2,048-token chunks over 8,192 keys at 331 against 264 (1.26x), Qwen3-0.6B's two 8k
prompts at 316 against 261; but 30 prompts of U[100,1024] tokens at 101 against 173 and a
2,112-token prompt beside 63 short extends at 0.90x: short sequences lose, FlashAttention's blocks
have few keys to walk and the gather and the copies cost as much as they save. So a step uses it
only when it holds an *anchor*: a sequence of at least :data:`FLASH_MIN_QUERY_LEN` new tokens over at
least :data:`FLASH_MIN_CONTEXT_LEN` keys. Then every sequence of the step with more than one new
token joins that one launch (a 6-token chunk continuation over 8k keys, alone in a Triton launch,
walks its keys on 8 programs and took longer than the rest of the step's attention: in the big
launch its latency hides), and the single-token (decode) sequences run on the split-K decode kernel
as a compacted batch. Steps without an anchor (the benchmark workload, the prefix burst) run
everything on the paged Triton kernels, as before.

The routing is decided once per step on the host, from lengths the model runner already has
(:func:`plan_flash_prefill`), so no layer reads anything back from the device.

>>> to_device = lambda arrays: [torch.as_tensor(np.asarray(a, dtype=np.int64)) for a in arrays]
>>> table = np.arange(8).reshape(2, 4)
>>> plan = plan_flash_prefill([1, 2000], [40, 4100], table, 2048, to_device)  # 2,048-token blocks
>>> plan.query_rows, plan.key_slots[[0, 2047, 2048]].tolist(), plan.rest[0].max_context_len
(slice(1, 2001, None), [8192, 10239, 10240], 40)
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# A step runs FlashAttention when a sequence brings at least this many new tokens over at least
# this many keys (from the round-1 A/B above; shorter ones lost to the Triton kernel).
FLASH_MIN_QUERY_LEN = 1024
FLASH_MIN_CONTEXT_LEN = 4096
# Keys gathered per layer at most (the first routed sequences up to it; later ones stay on Triton): the
# gathered copy is transient device memory outside the KV cache, 1 GiB at this cap for 8 KV heads of 128.
FLASH_MAX_GATHERED_KEYS = 1 << 18
# Off: every step runs the paged Triton kernels as before (benchmarks flip it for an A/B).
ENABLED = True
# cuDNN's attention (FlashAttention-3-class on Hopper) for steps whose routed sequences are all fresh
# (as many new tokens as keys: causal top-left is then bottom-right): see ``cudnn_fresh_attention``.
# H200, round 1 of 2026-12-02, two fresh 8k prompts, 32/8 heads of 128, bf16: SDPA's cuDNN backend
# 1.78 ms (619 TFLOP/s) against FA2's varlen 3.30 ms (333); cuDNN's own varlen op 66 ms (17): not used.
# A chunk continuation of at most CONTINUATION_AS_DECODE_ROWS tokens over its cached keys then runs
# as that many single-token rows on the split-K decode kernel (row j sees start + j + 1 keys), so the
# long mix's steps (fresh 8k prompts beside a few-token continuation) stay fresh. Off: FA2 as before.
# Off: in the engine (H200 round 2, 8B long mix of 8 requests, 5 prefill steps) the steps with prefill
# took 558 ms of device time on this route against 394 on FA2; not yet told apart: a one-time cuDNN
# graph build (the timed run was the route's first) or a per-call cost of the padded per-sequence calls.
CUDNN_FRESH = False
CONTINUATION_AS_DECODE_ROWS = 64
# Each fresh sequence runs as one dense SDPA call, padded to a multiple of this many tokens (padded keys
# come after every real query, so top-left causal never shows them), so cuDNN builds few graphs.
CUDNN_PAD_TOKENS = 256


@dataclass(slots=True)
class RestOfBatch:
    """Sequences of a step FlashAttention does not run, as a paged batch of their own."""

    token_rows: torch.Tensor       # [Tr] their tokens' rows in the step's flat batch
    block_tables: torch.Tensor     # [R, W] their block table rows
    context_lens: torch.Tensor     # [R]
    query_start_loc: torch.Tensor  # [R + 1] where each one's tokens start among token_rows
    max_query_len: int
    max_context_len: int


@dataclass(slots=True)
class FlashPrefillPlan:
    """Which sequences of a step run on FlashAttention and where their queries and keys are."""

    query_rows: slice | torch.Tensor  # their tokens in the flat batch: one range, or rows
    cu_seqlens_q: torch.Tensor        # int32 [F + 1] their query starts among those rows
    cu_seqlens_k: torch.Tensor        # int32 [F + 1] their key starts among key_slots
    key_slots: torch.Tensor           # [sum of their context lens] flat cache slot of each key, in order
    max_query_len: int
    max_context_len: int
    num_tokens: int                   # tokens in the whole step
    # Every routed sequence has as many new tokens as keys (no cached prefix) and the plan was made
    # for cuDNN (``use_cudnn``): paged_attention runs them on ``fresh_attention``, one by one.
    is_fresh: bool = False
    fresh_lens: tuple[int, ...] = ()  # then each routed sequence's length, in order
    # The other sequences: single-token ones (decode: the split-K kernel) and any the gather cap
    # left out (the paged prefill kernel), each group a batch of its own; empty when FlashAttention
    # runs them all.
    rest: tuple[RestOfBatch, ...] = ()


def plan_flash_prefill(num_new_tokens: Sequence[int], context_lens: Sequence[int], block_table: np.ndarray,
                       block_size: int, to_device: Callable[[list], list[torch.Tensor]],
                       min_query_len: int | None = None, min_context_len: int | None = None,
                       use_cudnn: bool | None = None) -> FlashPrefillPlan | None:
    """The plan for one step, or None when no sequence brings ``min_query_len`` new tokens over
    ``min_context_len`` keys (defaults :data:`FLASH_MIN_QUERY_LEN`, :data:`FLASH_MIN_CONTEXT_LEN`).
    With one, every sequence of more than one new token is routed, as long as the routed contexts
    add up to :data:`FLASH_MAX_GATHERED_KEYS` (anchors counted first). ``block_table`` ``[B, W]`` holds
    each sequence's block ids; ``to_device`` copies int64 host arrays to the device (the runner's
    pinned transfer). ``use_cudnn`` (with :data:`CUDNN_FRESH`; None: whether the current CUDA device
    :func:`is_cudnn_usable`): short continuations become decode rows (see
    :data:`CONTINUATION_AS_DECODE_ROWS`) and ``is_fresh`` says whether the routed rest has no cached keys."""
    min_query_len = FLASH_MIN_QUERY_LEN if min_query_len is None else min_query_len
    min_context_len = FLASH_MIN_CONTEXT_LEN if min_context_len is None else min_context_len
    query_lens = np.asarray(num_new_tokens, dtype=np.int64)
    contexts = np.asarray(context_lens, dtype=np.int64)
    is_anchor = (query_lens >= min_query_len) & (contexts >= min_context_len)
    if not ENABLED or not is_anchor.any():
        return None
    is_anchor &= np.cumsum(np.where(is_anchor, contexts, 0)) <= FLASH_MAX_GATHERED_KEYS
    if not is_anchor.any():
        return None
    is_joining = (query_lens > 1) & ~is_anchor
    room = FLASH_MAX_GATHERED_KEYS - int(contexts[is_anchor].sum())
    is_joining &= np.cumsum(np.where(is_joining, contexts, 0)) <= room
    use_cudnn = CUDNN_FRESH and (_cudnn_on_current_device() if use_cudnn is None else use_cudnn)
    # Short continuations over cached keys, as single-token rows of the decode group (cuDNN plans only).
    is_row_split = (is_joining & (query_lens <= CONTINUATION_AS_DECODE_ROWS) & (contexts > query_lens)
                    if use_cudnn else np.zeros_like(is_joining))
    is_routed = (is_anchor | is_joining) & ~is_row_split
    starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=starts[1:])
    routed = np.flatnonzero(is_routed)
    routed_contexts = contexts[routed]
    key_starts = _starts_of(routed_contexts)
    seq_of_key = np.repeat(routed, routed_contexts)
    positions = np.arange(key_starts[-1]) - np.repeat(key_starts[:-1], routed_contexts)
    key_slots = block_table[seq_of_key, positions // block_size] * block_size + positions % block_size
    is_one_range = bool((np.diff(routed) == 1).all())
    arrays = [key_slots, _starts_of(query_lens[routed]), key_starts]
    if not is_one_range:
        arrays.append(_rows_of(starts, routed))
    # Each group: its sequences, and for each of its tokens the sequence and the keys it sees (a decode
    # group's tokens are single-token rows: its own decodes and the row-split continuations, in order).
    decode_seqs = np.flatnonzero(~is_routed & ((query_lens == 1) | is_row_split))
    other_seqs = np.flatnonzero(~is_routed & (query_lens != 1) & ~is_row_split)
    groups = []
    if len(decode_seqs):
        row_seqs = np.repeat(decode_seqs, query_lens[decode_seqs])
        row_lens = (np.repeat(contexts[decode_seqs] - query_lens[decode_seqs], query_lens[decode_seqs])
                    + np.arange(len(row_seqs)) - np.repeat(_starts_of(query_lens[decode_seqs])[:-1],
                                                           query_lens[decode_seqs]) + 1)
        groups.append((decode_seqs, row_seqs, row_lens, np.ones(len(row_seqs), dtype=np.int64)))
    if len(other_seqs):
        groups.append((other_seqs, other_seqs, contexts[other_seqs], query_lens[other_seqs]))
    widths = []
    for seqs, row_seqs, row_lens, row_query_lens in groups:
        # Table rows as wide as the group's longest context, in multiples of 16 blocks (as the runner's:
        # the kernels specialize on the row stride).
        widths.append(min(block_table.shape[1], -(-int(row_lens.max()) // (16 * block_size)) * 16))
        arrays += [_rows_of(starts, seqs), block_table[row_seqs, :widths[-1]].reshape(-1), row_lens,
                   _starts_of(row_query_lens)]
    on_device = to_device(arrays)
    rest = []
    first = len(on_device) - 4 * len(groups)
    for index, ((_, row_seqs, row_lens, row_query_lens), width) in enumerate(zip(groups, widths)):
        rows, tables, lens, query_starts = on_device[first + 4 * index:first + 4 * index + 4]
        rest.append(RestOfBatch(token_rows=rows, block_tables=tables.view(len(row_seqs), width), context_lens=lens,
                                query_start_loc=query_starts, max_query_len=int(row_query_lens.max()),
                                max_context_len=int(row_lens.max())))
    query_rows = (slice(int(starts[routed[0]]), int(starts[routed[-1] + 1])) if is_one_range else on_device[3])
    is_fresh = use_cudnn and bool((query_lens[routed] == routed_contexts).all())
    return FlashPrefillPlan(query_rows=query_rows, cu_seqlens_q=on_device[1].to(torch.int32),
                            cu_seqlens_k=on_device[2].to(torch.int32), key_slots=on_device[0],
                            max_query_len=int(query_lens[routed].max()), max_context_len=int(routed_contexts.max()),
                            num_tokens=int(starts[-1]), rest=tuple(rest),
                            is_fresh=is_fresh, fresh_lens=tuple(query_lens[routed].tolist()) if is_fresh else ())


def _starts_of(lens: np.ndarray) -> np.ndarray:
    """``[0, lens[0], lens[0] + lens[1], ...]``: where each of ``lens`` starts, and the total."""
    starts = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=starts[1:])
    return starts


def _rows_of(starts: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """The flat-batch rows of sequences ``seqs``, in order (``starts``: ``[B + 1]`` query starts)."""
    lens = starts[seqs + 1] - starts[seqs]
    offsets = _starts_of(lens)
    return np.repeat(starts[seqs] - offsets[:-1], lens) + np.arange(offsets[-1])


def disable(reason: str) -> None:
    """Turns the routing off for the rest of the process, with a warning naming ``reason``: a torch
    whose op refuses what this module passes falls back to the Triton kernels instead of failing steps."""
    global ENABLED
    ENABLED = False
    warnings.warn(f"FlashAttention-2 prefill disabled, long prefills run on the Triton kernels: {reason}",
                  RuntimeWarning, stacklevel=2)


def is_cudnn_usable(device: torch.device) -> bool:
    """Whether fresh routed prompts may run on cuDNN's attention: a Hopper or newer GPU (measured there
    only), cuDNN present and SDPA's cuDNN backend in this torch."""
    if device.type != "cuda" or not hasattr(SDPBackend, "CUDNN_ATTENTION"):
        return False
    return torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device) >= (9, 0)


_CUDNN_USABLE: dict[int, bool] = {}


def _cudnn_on_current_device() -> bool:
    if not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device()
    if index not in _CUDNN_USABLE:
        _CUDNN_USABLE[index] = is_cudnn_usable(torch.device("cuda", index))
    return _CUDNN_USABLE[index]


def disable_cudnn(reason: str) -> None:
    """Fresh prompts go back to FlashAttention-2 for the rest of the process, with a warning."""
    global CUDNN_FRESH
    CUDNN_FRESH = False
    warnings.warn(f"cuDNN attention for fresh prefills disabled, they run on FlashAttention-2: {reason}",
                  RuntimeWarning, stacklevel=2)


def is_usable(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether steps on this device, in this dtype and cache dtype, should get a plan at all:
    CUDA with compute capability 8.0 or more (FlashAttention-2's minimum), fp16/bf16 activations in a
    cache of the same dtype (an fp8 cache stays on the Triton kernels, which read it with its scales),
    and a torch that has the op."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or cache_dtype != dtype:
        return False
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, soft_cap: float | None,
             kv_scales: torch.Tensor | None) -> bool:
    """Whether this layer's attention can run on FlashAttention: no logit soft cap (FA2 has none
    here), no cache scales, keys in the query's dtype, a head size FA2 takes (<= 256, multiple of 8) and
    caches whose slots flatten without a copy."""
    head_dim = query.shape[-1]
    return (soft_cap is None and kv_scales is None and key_cache.dtype == query.dtype and query.is_cuda
            and head_dim <= 256 and head_dim % 8 == 0 and key_cache.is_contiguous() and value_cache.is_contiguous())


# Layer configurations whose paged prefill kernel has run (see _warm_paged_prefill).
_WARMED: set[tuple] = set()


def _warm_paged_prefill(query, key_cache, value_cache, scale, sliding_window, attend_rest) -> None:
    """Runs ``attend_rest`` once on two queries over two cache slots (output dropped) the first time
    a layer configuration takes this path: with long prefills here, the paged prefill kernel may
    otherwise first run (and compile, seconds) on a short chunk in the middle of a timed run."""
    key = (query.device, query.dtype, query.shape[1:], key_cache.shape[2], sliding_window, attend_rest)
    if key in _WARMED:
        return
    _WARMED.add(key)
    device = query.device
    attend_rest(query.new_zeros(2, *query.shape[1:]), key_cache, value_cache,
                torch.zeros(1, 16, dtype=torch.long, device=device),
                torch.full((1,), 2, dtype=torch.long, device=device),
                torch.tensor([0, 2], device=device), 2, 2, scale, sliding_window)


def flash_varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_query_len, max_context_len, scale,
                           sliding_window):
    """torch's FlashAttention-2 varlen forward, causal with the queries at the end of each sequence's
    keys (bottom-right), GQA when key heads are fewer; a sliding window w sees the last w positions."""
    window = {} if sliding_window is None else dict(window_size_left=sliding_window - 1, window_size_right=0)
    return torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_query_len, max_context_len, 0.0, True, False,
        scale=scale, **window)[0]


def cudnn_fresh_attention(query, key, value, lens: Sequence[int], scale: float,
                          backends: Sequence = (SDPBackend.CUDNN_ATTENTION,)) -> torch.Tensor:
    """Causal attention of fresh sequences laid end to end (``query`` ``[T, Hq, D]``, ``key``/``value``
    ``[T, Hkv, D]``: each sequence's queries are its keys), one dense SDPA call per sequence on
    ``backends`` (cuDNN; the GQA heads in place), each padded to :data:`CUDNN_PAD_TOKENS`."""
    out = torch.empty_like(query)
    start = 0
    with sdpa_kernel(list(backends)):
        for length in lens:
            end, padding = start + length, -length % CUDNN_PAD_TOKENS
            parts = [x[start:end] if not padding else F.pad(x[start:end], (0, 0, 0, 0, 0, padding))
                     for x in (query, key, value)]
            q, k, v = (x.unsqueeze(0).transpose(1, 2) for x in parts)  # [1, H, S, D], strided
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            out[start:end] = attended[0, :, :length].transpose(0, 1)
            start = end
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    plan: FlashPrefillPlan, scale: float, sliding_window: int | None, attend_rest: Callable,
                    varlen_attention: Callable = flash_varlen_attention,
                    fresh_attention: Callable = cudnn_fresh_attention) -> torch.Tensor:
    """Causal attention of a step's queries ``[T, Hq, D]`` as ``reference.paged_attention`` computes
    it: the plan's sequences by ``varlen_attention`` over their gathered keys (``fresh_attention``, see
    :func:`cudnn_fresh_attention`, when the plan ``is_fresh``, no sliding window and :data:`CUDNN_FRESH`;
    ``varlen_attention`` for good once it raises), the others by ``attend_rest`` (``paged_attention``'s
    signature) on each group of :attr:`FlashPrefillPlan.rest`. Returns ``[T, Hq, D]``."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    _warm_paged_prefill(query, key_cache, value_cache, scale, sliding_window, attend_rest)
    keys = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, plan.key_slots)
    values = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, plan.key_slots)
    rows = plan.query_rows
    routed_query = query[rows] if isinstance(rows, slice) else query.index_select(0, rows)
    args = (routed_query, keys, values, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_query_len,
            plan.max_context_len, scale, sliding_window)
    routed_out = None
    if plan.is_fresh and sliding_window is None and CUDNN_FRESH:
        try:
            routed_out = fresh_attention(routed_query, keys, values, plan.fresh_lens, scale)
        except RuntimeError as error:  # a cuDNN that refuses these inputs: FA2 from now on
            disable_cudnn(f"{type(error).__name__}: {error}")
    if routed_out is None:
        routed_out = varlen_attention(*args)
    if not plan.rest:
        return routed_out
    out = query.new_empty(plan.num_tokens, query.shape[1], head_dim)
    if isinstance(rows, slice):
        out[rows] = routed_out
    else:
        out.index_copy_(0, rows, routed_out)
    for group in plan.rest:
        group_out = attend_rest(query.index_select(0, group.token_rows), key_cache, value_cache, group.block_tables,
                                group.context_lens, group.query_start_loc, group.max_query_len,
                                group.max_context_len, scale, sliding_window)
        out.index_copy_(0, group.token_rows, group_out)
    return out
