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

__all__ = ["argmax", "write_kv_cache", "paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul"]


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
                    max_query_len, max_context_len, scale, sliding_window=None):
    return _implementation("paged_attention", query)(
        query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
        max_query_len, max_context_len, scale, sliding_window)


def rms_norm(x, weight, eps, residual=None):
    return _implementation("rms_norm", x)(x, weight, eps, residual)


def rotary_embedding(query, key, positions, cos_sin_cache):
    return _implementation("rotary_embedding", query)(query, key, positions, cos_sin_cache)


def silu_and_mul(x):
    return _implementation("silu_and_mul", x)(x)


def argmax(x):
    return _implementation("argmax", x)(x)
