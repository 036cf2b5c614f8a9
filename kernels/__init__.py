"""Kernels, with one dispatch point.

Each op is a package holding its plain-torch reference (``reference.py``), a faster CPU routine
checked against it (``cpu.py``) and, where the GPU needs one, a Triton kernel
(``triton_<op>.py``): ``attention``, ``kv_cache``, ``attention_inputs``, ``norm``, ``rotary``,
``activation``, ``sampling`` and ``matmul`` (the linear op). The functions here pick the routine:
Triton for CUDA tensors, the CPU routine for CPU tensors, the reference for anything else; and for
:func:`linear`, by the weight's format too. Model code calls these names and never asks which
device it is on. (``kernels/moe`` dispatches itself.)

>>> from hearth_llm.kernels import silu_and_mul
>>> silu_and_mul(torch.ones(2, 8)).shape
torch.Size([2, 4])
"""
from __future__ import annotations


import torch

from . import activation, attention, attention_inputs, kv_cache, matmul, norm, rotary, sampling
from .lazy_triton import triton_module
from .matmul.formats import DenseWeight, Fp16Weight, Int4Weight, OnednnBf16Weight

__all__ = ["argmax", "sample_rows", "write_kv_cache", "paged_attention", "qk_norm_rope_and_cache", "rms_norm",
           "layer_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul", "gelu", "linear",
           "register_linear_routine", "linear_routine", "DenseWeight", "OnednnBf16Weight", "Fp16Weight", "Int4Weight"]


# ------------------------------------------------------------------------------------------
# Choosing a routine by device
# ------------------------------------------------------------------------------------------

def _triton_module(op):
    """The op's Triton module (``<op>/triton_<op>.py``), or None where Triton is unavailable."""
    return triton_module(op.__name__)


def _implementation(op, name: str, tensor: torch.Tensor):
    if tensor.is_cuda:
        triton_module = _triton_module(op)
        if triton_module is not None and hasattr(triton_module, name):
            return getattr(triton_module, name)
    elif tensor.device.type == "cpu":
        return getattr(op.cpu, name)
    return getattr(op.reference, name)


# ------------------------------------------------------------------------------------------
# The ops
# ------------------------------------------------------------------------------------------


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_scales=None):
    routine = _implementation(kv_cache, "write_kv_cache", key)
    if kv_scales is None:
        return routine(key, value, key_cache, value_cache, slot_mapping)
    return routine(key, value, key_cache, value_cache, slot_mapping, kv_scales)


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                    max_query_len, max_context_len, scale, sliding_window=None, soft_cap=None, kv_scales=None):
    routine = _implementation(attention, "paged_attention", query)
    if kv_scales is None:  # the CPU routine reads no quantized cache and takes no scales
        return routine(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                       max_query_len, max_context_len, scale, sliding_window, soft_cap)
    return routine(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                   max_query_len, max_context_len, scale, sliding_window, soft_cap, kv_scales)


def rms_norm(x, weight, eps, residual=None):
    return _implementation(norm, "rms_norm", x)(x, weight, eps, residual)


def layer_norm(x, weight, bias, eps, residual=None):
    return _implementation(norm, "layer_norm", x)(x, weight, bias, eps, residual)


def rotary_embedding(query, key, positions, cos_sin_cache, is_neox_style=True):
    return _implementation(rotary, "rotary_embedding", query)(query, key, positions, cos_sin_cache, is_neox_style)


def silu_and_mul(x):
    return _implementation(activation, "silu_and_mul", x)(x)


def gelu_and_mul(x, approximate="tanh"):
    return _implementation(activation, "gelu_and_mul", x)(x, approximate)


def gelu(x, approximate="tanh"):
    return _implementation(activation, "gelu", x)(x, approximate)


def argmax(x):
    return _implementation(sampling, "argmax", x)(x)


def sample_rows(logits, temperatures, **options):
    """One token per (sampled) row, nothing read back from the device; see ``sampling.reference.sample_rows``."""
    return _implementation(sampling, "sample_rows", logits)(logits, temperatures, **options)


def qk_norm_rope_and_cache(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                           num_kv_heads, q_norm_weight=None, k_norm_weight=None, eps=1e-6, is_neox_style=True,
                           kv_scales=None):
    """A layer's attention inputs from its fused projection ``qkv`` ``[T, (H + 2 Hkv) * D]``:
    RMS-norm each query and key head (when the norm weights are given, as in Qwen3), rotate them
    (as :func:`rotary_embedding`: partial when ``cos_sin_cache`` is narrower than D, GPT-J pairs
    when ``is_neox_style`` is False), store keys and values at ``slot_mapping`` in the paged cache
    (an fp8 cache: quantized with ``kv_scales``, see ``write_kv_cache``); returns the queries ``[T, H, D]``.

    On CUDA one Triton kernel does it all for full-width NeoX rotary; partial or GPT-J rotary on
    CUDA, and everything elsewhere, is the composition of the single ops below, which is also the
    reference the fused kernel is tested against.

    >>> cache = torch.zeros(4, 16, 1, 8)
    >>> qkv_rows, cos_sin = torch.randn(3, 4 * 8), torch.randn(64, 8)
    >>> qk_norm_rope_and_cache(qkv_rows, torch.arange(3), cos_sin, cache, cache.clone(), torch.arange(3), 2, 1).shape
    torch.Size([3, 2, 8])
    """
    if qkv.is_cuda:
        triton_module = _triton_module(attention_inputs)
        if triton_module is not None and triton_module.supports_fused_rotary(
                key_cache.shape[-1], cos_sin_cache.shape[-1], is_neox_style):
            return triton_module.qk_norm_rope_and_cache(qkv, positions, cos_sin_cache, key_cache, value_cache,
                                                        slot_mapping, num_heads, num_kv_heads, q_norm_weight,
                                                        k_norm_weight, eps, kv_scales=kv_scales)
    return qk_norm_rope_and_cache_unfused(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
                                          num_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, is_neox_style,
                                          kv_scales)


def qk_norm_rope_and_cache_unfused(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                                   num_kv_heads, q_norm_weight=None, k_norm_weight=None, eps=1e-6,
                                   is_neox_style=True, kv_scales=None):
    """The reference composition, run with the dispatched single ops (fast CPU routines on the CPU)."""
    return attention_inputs.reference.qk_norm_rope_and_cache(
        qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads,
        q_norm_weight, k_norm_weight, eps, is_neox_style, kv_scales,
        rms_norm=rms_norm, rotary_embedding=rotary_embedding, write_kv_cache=write_kv_cache)


# ------------------------------------------------------------------------------------------
# linear: by the weight's format and the input's device
# ------------------------------------------------------------------------------------------


def _fp16_linear(x, weight: Fp16Weight, bias):
    out = matmul.cpu.fp16_linear(x, weight.packed)
    return out if bias is None else out.add_(bias)


# (format, device type or None for any device) -> routine(x, weight, bias)
_LINEAR_ROUTINES = {
    (DenseWeight, None): lambda x, weight, bias: matmul.reference.dense_linear(x, weight.weight, bias),
    (OnednnBf16Weight, "cpu"): lambda x, weight, bias: matmul.cpu.dense_linear(x, weight.packed, bias),
    (Fp16Weight, "cpu"): _fp16_linear,
    (Int4Weight, "cpu"): lambda x, weight, bias: matmul.cpu.int4_linear(
        x, weight.packed, weight.scales_and_zeros, weight.group_size, bias),
}


# (format, device type) -> binder(weight, bias) -> routine(x); formats without one bind generically.
_LINEAR_BINDERS = {
    (OnednnBf16Weight, "cpu"): lambda weight, bias: matmul.cpu.dense_linear_routine(weight.packed, bias),
    (Fp16Weight, "cpu"): lambda weight, bias: matmul.cpu.fp16_linear_routine(weight.packed, bias),
    (Int4Weight, "cpu"): lambda weight, bias: matmul.cpu.int4_linear_routine(
        weight.packed, weight.scales_and_zeros, weight.group_size, bias),
}


def register_linear_routine(weight_format: type, device_type: str | None, routine) -> None:
    """Make :func:`linear` multiply weights of ``weight_format`` on ``device_type`` ("cpu",
    "cuda", or None for any) with ``routine(x, weight, bias)``; how a quantization method plugs in.

    >>> class Doubled(DenseWeight): ...
    >>> register_linear_routine(Doubled, None, lambda x, w, b: 2 * torch.nn.functional.linear(x, w.weight, b))
    >>> linear(torch.ones(1, 2), Doubled(torch.ones(3, 2))).tolist()
    [[4.0, 4.0, 4.0]]
    """
    _LINEAR_ROUTINES[(weight_format, device_type)] = routine
    _LINEAR_BINDERS.pop((weight_format, device_type), None)


def _linear_routine_for(weight, device_type: str):
    routine = _LINEAR_ROUTINES.get((type(weight), device_type)) or _LINEAR_ROUTINES.get((type(weight), None))
    if routine is None:
        registered = sorted(f"{weight_format.__name__} on {device or 'any device'}"
                            for weight_format, device in _LINEAR_ROUTINES)
        raise ValueError(f"no linear routine for weight format {type(weight).__name__} on {device_type} "
                         f"tensors; registered: {registered}")
    return routine


def linear_routine(weight, device_type: str, bias: torch.Tensor | None = None):
    """``x -> linear(x, weight, bias)`` for inputs on ``device_type``, with the routine chosen now:
    for a layer whose weight keeps its format and device, so each call is a single Python call
    (decode steps of a small model are bound by per-call overhead as much as by the matmuls).

    >>> routine = linear_routine(DenseWeight(torch.ones(3, 2)), "cpu", torch.ones(3))
    >>> routine(torch.ones(1, 2)).tolist()
    [[3.0, 3.0, 3.0]]
    """
    binder = _LINEAR_BINDERS.get((type(weight), device_type))
    if binder is not None:
        return binder(weight, bias)
    routine = _linear_routine_for(weight, device_type)
    return lambda x: routine(x, weight, bias)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` and a weight in one of the formats of
    ``kernels.matmul.formats`` (``DenseWeight``, ``OnednnBf16Weight``, ``Fp16Weight`` (float32
    out), ``Int4Weight``), by the routine registered for that format on ``x``'s device.

    >>> linear(torch.ones(1, 2), DenseWeight(torch.ones(3, 2)), torch.ones(3)).tolist()
    [[3.0, 3.0, 3.0]]
    """
    return _linear_routine_for(weight, x.device.type)(x, weight, bias)
