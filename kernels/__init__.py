"""Kernels, with one dispatch point: Triton on CUDA tensors, faster CPU routines (``cpu_ops``,
checked against the reference) on CPU tensors, the torch reference for anything else.

Model code calls these names and never asks which device it is on.

>>> from hearth_llm.kernels import silu_and_mul
>>> silu_and_mul(torch.ones(2, 8)).shape
torch.Size([2, 4])
"""
from __future__ import annotations

import torch

from . import cpu_ops, reference

__all__ = ["argmax", "write_kv_cache", "paged_attention", "qk_norm_rope_and_cache", "rms_norm", "layer_norm",
           "rotary_embedding", "silu_and_mul", "gelu_and_mul", "gelu"]


def _triton_module():
    """The Triton implementations, or None where Triton or CUDA is unavailable."""
    global _TRITON
    if _TRITON is _UNSET:
        try:
            from . import triton_ops
        except ImportError:
            triton_ops = None
        _TRITON = triton_ops
    return _TRITON


_UNSET = object()
_TRITON = _UNSET


def _implementation(name: str, tensor: torch.Tensor):
    if tensor.is_cuda:
        triton_ops = _triton_module()
        if triton_ops is not None and hasattr(triton_ops, name):
            return getattr(triton_ops, name)
    elif tensor.device.type == "cpu":
        return getattr(cpu_ops, name)
    return getattr(reference, name)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    return _implementation("write_kv_cache", key)(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                    max_query_len, max_context_len, scale, sliding_window=None, soft_cap=None):
    return _implementation("paged_attention", query)(
        query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
        max_query_len, max_context_len, scale, sliding_window, soft_cap)


def rms_norm(x, weight, eps, residual=None):
    return _implementation("rms_norm", x)(x, weight, eps, residual)


def layer_norm(x, weight, bias, eps, residual=None):
    return _implementation("layer_norm", x)(x, weight, bias, eps, residual)


def rotary_embedding(query, key, positions, cos_sin_cache, is_neox_style=True):
    return _implementation("rotary_embedding", query)(query, key, positions, cos_sin_cache, is_neox_style)


def silu_and_mul(x):
    return _implementation("silu_and_mul", x)(x)


def gelu_and_mul(x, approximate="tanh"):
    return _implementation("gelu_and_mul", x)(x, approximate)


def gelu(x, approximate="tanh"):
    return _implementation("gelu", x)(x, approximate)


def argmax(x):
    return _implementation("argmax", x)(x)


def qk_norm_rope_and_cache(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                           num_kv_heads, q_norm_weight=None, k_norm_weight=None, eps=1e-6, is_neox_style=True):
    """A layer's attention inputs from its fused projection ``qkv`` ``[T, (H + 2 Hkv) * D]``:
    RMS-norm each query and key head (when the norm weights are given, as in Qwen3), rotate them
    (as :func:`rotary_embedding`: partial when ``cos_sin_cache`` is narrower than D, GPT-J pairs
    when ``is_neox_style`` is False), store keys and values at ``slot_mapping`` in the paged cache;
    returns the queries ``[T, H, D]``.

    On CUDA one Triton kernel does it all for full-width NeoX rotary; partial or GPT-J rotary on
    CUDA, and everything elsewhere, is the composition of the single ops below, which is also the
    reference the fused kernel is tested against.

    >>> cache = torch.zeros(4, 16, 1, 8)
    >>> qkv_rows, cos_sin = torch.randn(3, 4 * 8), torch.randn(64, 8)
    >>> qk_norm_rope_and_cache(qkv_rows, torch.arange(3), cos_sin, cache, cache.clone(), torch.arange(3), 2, 1).shape
    torch.Size([3, 2, 8])
    """
    if qkv.is_cuda:
        triton_ops = _triton_module()
        if triton_ops is not None and triton_ops.supports_fused_rotary(key_cache.shape[-1], cos_sin_cache.shape[-1],
                                                                         is_neox_style):
            return triton_ops.qk_norm_rope_and_cache(qkv, positions, cos_sin_cache, key_cache, value_cache,
                                                     slot_mapping, num_heads, num_kv_heads, q_norm_weight,
                                                     k_norm_weight, eps)
    return qk_norm_rope_and_cache_unfused(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
                                          num_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, is_neox_style)


def qk_norm_rope_and_cache_unfused(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                                   num_kv_heads, q_norm_weight=None, k_norm_weight=None, eps=1e-6,
                                   is_neox_style=True):
    head_dim = key_cache.shape[-1]
    num_tokens = qkv.shape[0]
    query, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    query = query.view(num_tokens, num_heads, head_dim)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        query, _ = rms_norm(query, q_norm_weight, eps)
        key, _ = rms_norm(key, k_norm_weight, eps)
    query, key = rotary_embedding(query, key, positions, cos_sin_cache, is_neox_style)
    write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    return query
