"""Faster CPU versions of the kernels in ``reference.py``: same signatures, same results up to rounding.

On a CPU a small model's decode step is hundreds of tiny ops, so what costs time is the number of
ops, not their arithmetic. Where ``reference.py`` uses one general formulation, these routines pick
a shorter one for the shapes a CPU engine runs most (decode steps with one query per sequence, a
single sequence's prefill), and they compute what depends only on the step's metadata (masks,
gather indices, rotary tables) once per step instead of once per layer.

>>> import torch
>>> from hearth_llm.kernels import cpu_ops
>>> normed, summed = cpu_ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)

The second half of the file holds the weight formats for CPU matmuls: oneDNN-prepacked dense
weights and 4-bit group-quantized weights (used only where they are lossless, e.g. for weights
that came from a Q4 GGUF file).
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from . import reference

# ------------------------------------------------------------------------------------------
# Values derived from one step's metadata, shared by every layer of that step
# ------------------------------------------------------------------------------------------


class _StepMemo:
    """Caches a value computed from a few small tensors until the tensors change.

    Every layer of a step passes the same metadata, so one computation serves the whole step. A
    tensor in the key matches by identity and version counter when it has one; tensors made under
    ``torch.inference_mode()`` have none, so they match by content (the metadata is small).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, name: str, key: tuple, compute):
        """``compute()``, or its value from the last call with an equal ``key``."""
        entries = self._local.__dict__.setdefault("entries", {})
        entry = entries.get(name)
        if entry is not None and _matches(entry[0], key):
            return entry[1]
        value = compute()
        entries[name] = (tuple(_snapshot(item) for item in key), value)
        return value


def _snapshot(item):
    if not isinstance(item, torch.Tensor):
        return ("value", item)
    if item.is_inference():
        return ("content", item.clone())
    return ("identity", item, item._version)


def _matches(snapshots: tuple, key: tuple) -> bool:
    for snapshot, item in zip(snapshots, key):
        kind = snapshot[0]
        if kind == "value":
            if isinstance(item, torch.Tensor) or snapshot[1] != item:
                return False
        elif not isinstance(item, torch.Tensor):
            return False
        elif kind == "content":
            if not item.is_inference() or not torch.equal(snapshot[1], item):
                return False
        elif snapshot[1] is not item or snapshot[2] != item._version:
            return False
    return True


_memo = _StepMemo()


# ------------------------------------------------------------------------------------------
# The kernels
# ------------------------------------------------------------------------------------------


# From this many new tokens on, a write to one consecutive run of slots is a slice copy: index_copy_
# costs ~23 us for 500 tokens against ~8 us for the copy, while for a few tokens the once-per-step
# check would cost more than it saves.
_MIN_TOKENS_FOR_SLICE_WRITE = 64


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """As :func:`reference.write_kv_cache`, without its conversions when the dtypes already match."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.dtype != key_cache.dtype:
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    key_slots, value_slots = key_cache.view(-1, num_kv_heads, head_dim), value_cache.view(-1, num_kv_heads, head_dim)
    first_slot = _first_slot_of_one_run(slot_mapping) if num_tokens >= _MIN_TOKENS_FOR_SLICE_WRITE else None
    if first_slot is None:
        key_slots.index_copy_(0, slot_mapping, key)
        value_slots.index_copy_(0, slot_mapping, value)
    else:
        key_slots.narrow(0, first_slot, num_tokens).copy_(key)
        value_slots.narrow(0, first_slot, num_tokens).copy_(value)


def _first_slot_of_one_run(slot_mapping: torch.Tensor) -> int | None:
    """The first slot when the slots are consecutive (a fresh prefill in consecutive blocks), else
    None; read on the host once per step, as this path only ever sees CPU tensors."""
    def compute():
        slots = slot_mapping.tolist()
        return slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None

    return _memo.get("first_slot_of_one_run", (slot_mapping,), compute)


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                    max_query_len, max_context_len, scale, sliding_window=None, soft_cap=None):
    """As :func:`reference.paged_attention`, with shortcuts for decode steps and single prefills.

    Every shortcut calls ``reference.scaled_dot_product_attention``: SDPA itself, or with a
    ``soft_cap`` the written-out attention that caps the scores.
    """
    reference.check_soft_cap(soft_cap)
    num_seqs = context_lens.shape[0]
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_tokens == 0 or num_heads % num_kv_heads:
        return reference.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                         query_start_loc, max_query_len, max_context_len, scale, sliding_window,
                                         soft_cap)
    if max_query_len == 1 and num_tokens == num_seqs:
        return _decode_attention(query, key_cache, value_cache, block_tables, context_lens, max_context_len,
                                 scale, sliding_window, soft_cap)
    if num_seqs == 1:
        return _single_sequence_attention(query, key_cache, value_cache, block_tables, context_lens,
                                          max_context_len, scale, sliding_window, soft_cap)
    return _varlen_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                             max_query_len, max_context_len, scale, sliding_window, soft_cap)


def _gather(cache: torch.Tensor, blocks: tuple, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
    """The blocks of each sequence as ``[B, Hkv, padded_len, D]``: a view when they are one
    contiguous run of the cache (as a lone sequence's fresh blocks usually are), else a copy."""
    flat_blocks, first_block = blocks
    _, block_size, num_kv_heads, head_dim = cache.shape
    if first_block is not None:
        gathered = cache.narrow(0, first_block, flat_blocks.shape[0])
    else:
        gathered = cache.index_select(0, flat_blocks)
    gathered = gathered.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    return gathered if gathered.dtype == dtype else gathered.to(dtype)


def _context_blocks(block_tables: torch.Tensor, num_context_blocks: int) -> tuple:
    """``(flat block ids, first id if they are consecutive else None)``, once per step."""
    def compute():
        flat_blocks = block_tables[:, :num_context_blocks].reshape(-1).long()
        ids = flat_blocks.tolist() if flat_blocks.shape[0] <= 4096 else []
        is_one_run = bool(ids) and ids == list(range(ids[0], ids[0] + len(ids)))
        return flat_blocks, ids[0] if is_one_run else None

    return _memo.get("context_blocks", (block_tables, num_context_blocks), compute)


def _decode_attention(query, key_cache, value_cache, block_tables, context_lens, max_context_len, scale,
                      sliding_window, soft_cap=None):
    """One query per sequence: the query heads that share a KV head become that head's query rows,
    so the attention is a plain (non-GQA) SDPA call over the gathered keys."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_context_blocks = -(-max_context_len // block_size)
    blocks = _context_blocks(block_tables, num_context_blocks)
    keys = _gather(key_cache, blocks, num_seqs, query.dtype)
    values = _gather(value_cache, blocks, num_seqs, query.dtype)
    grouped_query = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = _decode_mask(context_lens, num_context_blocks * block_size, max_context_len, sliding_window)
    if mask is None:  # one sequence and no window: its first max_context_len keys, nothing to hide
        keys, values = keys[:, :, :max_context_len], values[:, :, :max_context_len]
    out = reference.scaled_dot_product_attention(grouped_query, keys, values, attn_mask=mask, scale=scale,
                                                 soft_cap=soft_cap)
    return out.view(num_seqs, num_heads, head_dim)


def _decode_mask(context_lens, padded_len, max_context_len, sliding_window):
    if context_lens.shape[0] == 1 and sliding_window is None:
        return None

    def compute():
        key_pos = torch.arange(padded_len, device=context_lens.device)
        visible = key_pos[None, :] < context_lens[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] >= (context_lens[:, None] - sliding_window)
        return visible[:, None, None, :]

    return _memo.get("decode_mask", (context_lens, padded_len, sliding_window), compute)


# Causal attention of a long prefill runs in chunks of this many queries, each against only the
# keys it can see: SDPA's CPU kernel computes whole key blocks and masks them afterwards, so one
# call does nearly twice the necessary work (measured 20 % faster for a 500-token prefill).
_PREFILL_QUERY_CHUNK = 64


def _single_sequence_attention(query, key_cache, value_cache, block_tables, context_lens, max_context_len, scale,
                               sliding_window, soft_cap=None):
    """One sequence's prefill (or prefill chunk after a cached prefix): no padding, so no gather
    of other sequences, and for a short fresh prefill without a window, SDPA's own causal path."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_context_blocks = -(-max_context_len // block_size)
    blocks = _context_blocks(block_tables, num_context_blocks)
    keys = _gather(key_cache, blocks, 1, query.dtype)[:, :, :max_context_len]
    values = _gather(value_cache, blocks, 1, query.dtype)[:, :, :max_context_len]
    if num_tokens < 2 * _PREFILL_QUERY_CHUNK:
        queries = query.transpose(0, 1).unsqueeze(0)
        is_fresh = num_tokens == max_context_len
        mask = None if is_fresh and sliding_window is None else _prefill_biases(
            num_tokens, max_context_len, sliding_window, num_tokens, 1, query.dtype, query.device)[0]
        out = reference.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=mask is None,
                                                     scale=scale, enable_gqa=num_heads != num_kv_heads,
                                                     soft_cap=soft_cap)
        return out[0].transpose(0, 1)
    return _chunked_prefill_attention(query, keys, values, max_context_len, scale, sliding_window, soft_cap)


def _chunked_prefill_attention(query, keys, values, context_len, scale, sliding_window, soft_cap=None):
    """Causal attention in chunks of queries, with the query heads that share a KV head stacked as
    that head's rows (token-major): the SDPA calls are then plain multi-head ones with three times
    the rows, which its CPU kernel runs ~10 % faster than the GQA form, and each chunk's result is
    copied straight into the output instead of concatenated at the end."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    num_queries_per_kv = num_heads // num_kv_heads
    grouped_query = query.view(num_tokens, num_kv_heads, num_queries_per_kv, head_dim).transpose(0, 1)
    grouped_query = grouped_query.reshape(1, num_kv_heads, num_tokens * num_queries_per_kv, head_dim)
    out = query.new_empty(num_tokens, num_kv_heads, num_queries_per_kv, head_dim)
    out_by_kv_head = out.transpose(0, 1)
    biases = _prefill_biases(num_tokens, context_len, sliding_window, _PREFILL_QUERY_CHUNK, num_queries_per_kv,
                             query.dtype, query.device)
    first_query_pos = context_len - num_tokens
    for bias, start in zip(biases, range(0, num_tokens, _PREFILL_QUERY_CHUNK)):
        end = min(start + _PREFILL_QUERY_CHUNK, num_tokens)
        num_visible = first_query_pos + end
        chunk_out = reference.scaled_dot_product_attention(
            grouped_query[:, :, start * num_queries_per_kv:end * num_queries_per_kv], keys[:, :, :num_visible],
            values[:, :, :num_visible], attn_mask=bias, scale=scale, soft_cap=soft_cap)
        out_by_kv_head[:, start:end].copy_(chunk_out[0].view(num_kv_heads, end - start, num_queries_per_kv, head_dim))
    return out.view(num_tokens, num_heads, head_dim)


def _prefill_biases(num_tokens, context_len, sliding_window, chunk, rows_per_query, dtype, device):
    """Per chunk of ``chunk`` queries, an additive mask (0 or -inf) over the keys up to its last
    query, each query's row repeated ``rows_per_query`` times (once per query head of a KV head).

    Additive rather than boolean because SDPA's CPU kernel turns a boolean mask into this on every
    call (measured 6 % of a 500-token prefill's attention)."""
    def compute():
        biases = []
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            first_query_pos = context_len - num_tokens
            query_pos = torch.arange(first_query_pos + start, first_query_pos + end, device=device)[:, None]
            key_pos = torch.arange(first_query_pos + end, device=device)[None, :]
            visible = key_pos <= query_pos
            if sliding_window is not None:
                visible &= key_pos > query_pos - sliding_window
            bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            biases.append(bias.repeat_interleave(rows_per_query, dim=0))
        return biases

    return _memo.get("prefill_biases", (num_tokens, context_len, sliding_window, chunk, rows_per_query, dtype),
                     compute)


def _varlen_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc, max_query_len,
                      max_context_len, scale, sliding_window, soft_cap=None):
    """A mixed batch: the reference's padded formulation, with its index and mask tensors built once
    per step."""
    num_seqs = context_lens.shape[0]
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_context_blocks = -(-max_context_len // block_size)
    padded_len = num_context_blocks * block_size

    def plan():
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=query.device), query_lens,
                                            output_size=num_tokens)
        token_row = torch.arange(num_tokens, device=query.device) - query_start_loc[token_seq]
        query_pos = (context_lens - query_lens)[:, None] + torch.arange(max_query_len, device=query.device)[None]
        key_pos = torch.arange(padded_len, device=query.device)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
        return token_seq, token_row, mask[:, None]

    token_seq, token_row, mask = _memo.get(
        "varlen_plan", (query_start_loc, context_lens, max_query_len, padded_len, sliding_window), plan)
    blocks = _context_blocks(block_tables, num_context_blocks)
    keys = _gather(key_cache, blocks, num_seqs, query.dtype)
    values = _gather(value_cache, blocks, num_seqs, query.dtype)
    padded_query = query.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    padded_query[token_seq, token_row] = query
    out = reference.scaled_dot_product_attention(padded_query.transpose(1, 2), keys, values, attn_mask=mask,
                                                 scale=scale, enable_gqa=num_heads != num_kv_heads, soft_cap=soft_cap)
    return out.transpose(1, 2)[token_seq, token_row]


def rms_norm(x, weight, eps, residual=None):
    """As :func:`reference.rms_norm`, through torch's one fused norm kernel.

    ``F.rms_norm`` is several ops on the CPU (and slow in bf16); ``F.layer_norm`` is one. Over
    ``[x, -x]`` the mean is zero and the variance is ``mean(x**2)``, so layer norm of that, cut back
    to its first half, is the RMS norm of ``x``.
    """
    if residual is not None:
        x = x + residual
    size = x.shape[-1]
    normed = F.layer_norm(torch.cat((x, x.neg()), dim=-1), (2 * size,), None, None, eps)[..., :size]
    return normed * weight, x


def rotary_embedding(query, key, positions, cos_sin_cache, is_neox_style=True):
    """As :func:`reference.rotary_embedding`, with queries and keys rotated together in four ops.

    Rotate-half is ``x * cos + roll(x, R/2) * [-sin, sin]``; GPT-J style is the same with each pair
    of dims swapped instead of rolled. The full-width tables are built once per step. A partial
    rotary (R < D) rotates only the first R dims and passes the rest through.
    """
    head_dim, rotary_dim = query.shape[-1], cos_sin_cache.shape[-1]
    if not is_neox_style or rotary_dim != head_dim:
        return _rotary_embedding_general(query, key, positions, cos_sin_cache, is_neox_style)
    num_query_heads = query.shape[1]
    cos, signed_sin = _memo.get("rotary", (positions, cos_sin_cache), lambda: _rotary_tables(positions, cos_sin_cache))
    both = torch.cat((query, key), dim=1)
    rotated = torch.addcmul(both * cos, both.roll(both.shape[-1] // 2, dims=-1), signed_sin)
    return rotated[:, :num_query_heads], rotated[:, num_query_heads:]


def _rotary_tables(positions, cos_sin_cache):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def _rotary_embedding_general(query, key, positions, cos_sin_cache, is_neox_style):
    reference.check_rotary_dim(query.shape[-1], cos_sin_cache.shape[-1])
    rotary_dim, num_query_heads = cos_sin_cache.shape[-1], query.shape[1]
    if is_neox_style:
        cos, signed_sin = _memo.get("rotary", (positions, cos_sin_cache),
                                    lambda: _rotary_tables(positions, cos_sin_cache))
    else:
        cos, signed_sin = _memo.get("rotary_interleaved", (positions, cos_sin_cache),
                                    lambda: _interleaved_rotary_tables(positions, cos_sin_cache))
    both = torch.cat((query, key), dim=1)
    rotating = both[..., :rotary_dim]
    if is_neox_style:
        partners = rotating.roll(rotary_dim // 2, dims=-1)
    else:
        partners = rotating.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    rotated = torch.addcmul(rotating * cos, partners, signed_sin).to(both.dtype)
    if rotary_dim < both.shape[-1]:
        rotated = torch.cat((rotated, both[..., rotary_dim:]), dim=-1)
    return rotated[:, :num_query_heads], rotated[:, num_query_heads:]


def _interleaved_rotary_tables(positions, cos_sin_cache):
    """GPT-J style: dims 2i and 2i + 1 share cos_i and sin_i; the even dim takes -sin."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    signed_sin = torch.stack((-sin, sin), dim=-1).flatten(-2)
    return cos.repeat_interleave(2, dim=-1)[:, None, :], signed_sin[:, None, :]


def silu_and_mul(x):
    """As :func:`reference.silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_and_mul(x, approximate="tanh"):
    """As :func:`reference.gelu_and_mul`."""
    reference.check_gelu_approximate(approximate)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate).mul_(up)


def gelu(x, approximate="tanh"):
    """As :func:`reference.gelu`."""
    return reference.gelu(x, approximate)


def layer_norm(x, weight, bias, eps, residual=None):
    """As :func:`reference.layer_norm`, in torch's one fused kernel (float32 inside, as the reference)."""
    if residual is not None:
        x = x + residual
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return reference.layer_norm(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps), x


# torch's argmax and topk scan a row element by element; amax is vectorized and ~20x faster. Over
# a vocabulary-wide row it pays to find the best chunks with amax first and search only those.
_MIN_ROWS_FOR_CHUNKED_SEARCH = 4


def argmax(x: torch.Tensor) -> torch.Tensor:
    """As :func:`reference.argmax`: the index of each row's first maximum (NaN counts as largest)."""
    rows, width = x.shape
    chunk = _chunk_size(width)
    if rows < _MIN_ROWS_FOR_CHUNKED_SEARCH or chunk == 1:
        return x.argmax(dim=-1)
    chunks = x.reshape(rows, width // chunk, chunk)
    # argmax takes the first best chunk, then the first best element in it: the first maximum overall.
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)
    within = chunks[torch.arange(rows, device=x.device), best_chunk].argmax(dim=-1)
    return best_chunk * chunk + within


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's ``k`` largest values (ties in any order), as ``x.topk(k).indices``.

    The chunks holding the k largest values are among the k chunks with the largest maxima.
    """
    rows, width = x.shape
    chunk = _chunk_size(width)
    num_chunks = width // max(chunk, 1)
    if rows < _MIN_ROWS_FOR_CHUNKED_SEARCH or chunk == 1 or num_chunks <= k:
        return x.topk(k, dim=-1).indices
    chunks = x.reshape(rows, num_chunks, chunk)
    top_chunks = chunks.amax(dim=-1).topk(k, dim=-1).indices
    candidates = chunks[torch.arange(rows, device=x.device)[:, None], top_chunks].view(rows, k * chunk)
    best = candidates.topk(k, dim=-1).indices
    return top_chunks.gather(1, best // chunk) * chunk + best % chunk


def _chunk_size(width: int) -> int:
    """The largest power of two up to 1024 that divides ``width`` (1 when it is odd)."""
    chunk = 1024
    while chunk > 1 and width % chunk:
        chunk //= 2
    return chunk


# ------------------------------------------------------------------------------------------
# Weight formats for CPU matmuls
# ------------------------------------------------------------------------------------------

# Rows per 4-bit scale/offset pair: llama.cpp's Q4_0/Q4_1 block size.
INT4_GROUP_SIZE = 32


def pack_dense_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A ``[N, K]`` bf16 weight reordered into oneDNN's blocked layout, for :func:`dense_linear`.

    ``F.linear`` reorders a plain bf16 weight on every call; doing it once makes decode-size
    matmuls up to twice as fast. None where this torch build has no bf16 oneDNN.
    """
    if weight.dtype != torch.bfloat16 or not has_onednn_bf16():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def dense_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight from :func:`pack_dense_weight`; ``x`` is ``[M, K]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def has_onednn_bf16() -> bool:
    """Whether this torch build and CPU run oneDNN's bf16 matmuls (AVX-512 BF16 or AMX)."""
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def pack_fp16_weight(weight: torch.Tensor):
    """fbgemm's packed fp16 copy of a ``[N, K]`` weight, for :func:`fp16_linear`; None without fbgemm.

    For a few rows against a wide weight (the vocabulary projection) its kernel reads memory about
    twice as fast as oneDNN's bf16 one, and fp16 holds the weight more exactly than bf16.
    """
    try:
        return torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), None)
    except (AttributeError, RuntimeError):
        return None


def fp16_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """``x @ W.T`` in float32 for a weight from :func:`pack_fp16_weight`."""
    return torch.ops.quantized.linear_dynamic_fp16(x.float(), packed)


def int4_weight_if_lossless(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE):
    """``(packed, scales_and_zeros)`` for :func:`int4_linear` when every group of ``group_size``
    inputs of every row holds at most 16 evenly spaced values from its minimum to its maximum
    (as in weights dequantized from a Q4_1 or Q4_0 GGUF file) up to the weight's own rounding;
    otherwise None, because 4 bits would lose precision.

    >>> codes = torch.randint(0, 16, (16, 64)); codes[:, ::32] = 0; codes[:, 1::32] = 15
    >>> int4_weight_if_lossless((codes * 0.01 - 0.07).bfloat16()) is not None
    True
    >>> int4_weight_if_lossless(torch.randn(16, 64).bfloat16()) is None
    True
    """
    num_rows, num_inputs = weight.shape
    # The packing kernel wants whole groups and output rows in multiples of 16.
    if weight.dtype != torch.bfloat16 or num_inputs % group_size or num_rows % 16:
        return None
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    # Checking a sample of rows is enough: a weight that is not on a grid fails almost anywhere,
    # and checking every element would double the cost of a load.
    sample_rows = torch.linspace(0, num_rows - 1, min(num_rows, 64)).long()
    if not _is_on_int4_grid(weight[sample_rows], group_size):
        return None
    codes, scales, minimums = _int4_codes(weight, group_size)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(num_rows, num_inputs), 1)
    # The kernel computes (code - 8) * scale + zero.
    scales_and_zeros = torch.stack((scales, minimums + 8 * scales), dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros.to(weight.dtype)


def _int4_codes(weight: torch.Tensor, group_size: int):
    groups = weight.float().view(weight.shape[0], -1, group_size)
    minimums, maximums = groups.amin(dim=-1), groups.amax(dim=-1)  # each ~10x faster than aminmax here
    scales = (maximums - minimums) / 15
    inverse_scales = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    codes = groups.sub_(minimums[..., None]).mul_(inverse_scales[..., None]).round_().clamp_(0, 15)
    return codes.to(torch.int32), scales, minimums


def _is_on_int4_grid(weight: torch.Tensor, group_size: int) -> bool:
    codes, scales, minimums = _int4_codes(weight, group_size)
    groups = weight.float().view(weight.shape[0], -1, group_size)
    error = (codes * scales[..., None] + minimums[..., None] - groups).abs_()
    # bf16 keeps 8 significant bits, so a weight, and the minimum and maximum the grid is rebuilt
    # from, are each only this exact; twice their rounding leaves a margin. Off-grid weights miss
    # their nearest step by up to half a step, far more than this.
    largest = torch.maximum(minimums.abs(), (minimums + 15 * scales).abs())[..., None]
    tolerance = (groups.abs() + 3 * largest) * 2.0**-8 + scales[..., None] * 2.0**-6
    return bool((error <= tolerance).all())


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                group_size: int = INT4_GROUP_SIZE, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight from :func:`int4_weight_if_lossless`; ``x`` is bf16 ``[M, K]``."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
    return out if bias is None else out.add_(bias)
