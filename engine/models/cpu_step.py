"""A CPU step of a few query rows through the plain decoder layers, with the ops between the matmuls
in C (``kernels/cpu_step_native.py``): one call for RMSNorm of ``x + residual`` (the residual updated in
place), one for rotary + cache write + attention, one for SwiGLU.

On a small model the step outside the matmuls is more than half the time as torch ops (SmolLM2-135M
Q4_1, 1 thread, bf16, AVX-512 EPYC, 200 cached positions, CPU µs per layer, one row: norms 81,
rotary + cache 67, attention 96, SwiGLU 24, Python between them ~80, against ~230 for the four
GEMVs). Here each layer is four C calls beside its four linear layers (norms 16, attention with rotary
and cache 34-45, SwiGLU 8, Python ~35), the step's metadata is checked once for all layers, and the
layers' parts are gathered once per model: a one-row step 15.2 -> 9.7 ms of CPU, five rows (a
speculative verification) 28.9 -> 19.8 ms, measured in one process, alternating.

Where every linear runs the GGUF C GEMVs (a GGUF model kept in its blocks: in bf16 of Q4_0/Q4_1/
Q8_0/Q4_K/Q6_K tensors, the AVX-512 BF16 path; in float32 of any kept type or the AVX2 path's panels)
and the step has at most ``gguf_cpu_native.MAX_ROWS`` rows, all the layers go down in one C call
(:class:`~hearth_llm.kernels.cpu_step_native.DecoderLayers`): the same kernel calls in the same order,
bit-equal, without the ~10 Python calls a layer between them. Measured
2026-12-03 (Xeon with AMX, 1 thread, the bundled SmolLM2 Q4_1, 128 tokens after a 16-token prompt,
ms/token, 8 runs alternating in one process, ``NATIVE_LAYERS`` off / on): median 28.6 / 23.4, best 25.7 /
20.4; libpython + libtorch went from ~19 % of the samples (perf) to ~7 %.

It takes a step when every layer is the plain :class:`~.decoder.DecoderLayer` (RMSNorm, attention
without soft cap, per-head q/k RMSNorms or none (Qwen3's: normed in C before the attention call), NeoX rotary, SwiGLU MLP), the tensors are CPU float32 or bf16 with an
unquantized cache, and no sequence has more than :data:`MAX_QUERY_ROWS` new tokens (decode and
speculative verification); anything else runs the layers' own forward. ``ENABLED = False`` (or
``HEARTH_LLM_CPU_STEP_KERNELS=0``) turns it off.

>>> hidden = run_layers(model, hidden, positions, kv_caches, meta)   # None: not taken
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth_llm import kernels
from hearth_llm.kernels import cpu_step_native
from hearth_llm.kernels.quant import gguf_cpu_native

from .attention import Attention, AttentionMetadata
from .mlp import GatedMLP
from .norms import RMSNorm

# Query rows per sequence up to which a step takes this path (a verification of 7 proposals is 8).
MAX_QUERY_ROWS = 8
ENABLED = True
# Steps of up to gguf_cpu_native.MAX_ROWS rows whose every linear runs the GGUF C GEMVs: all layers in
# one C call (cpu_step_native.DecoderLayers), the same calls as the loop below makes.
NATIVE_LAYERS = True


@dataclass(slots=True)
class _Layer:
    """What one layer's CPU step reads, gathered once per model."""

    input_norm: RMSNorm
    post_norm: RMSNorm
    qkv_proj: torch.nn.Module
    o_proj: torch.nn.Module
    gate_up_proj: torch.nn.Module
    down_proj: torch.nn.Module
    rotary: torch.nn.Module
    num_heads: int
    num_kv_heads: int
    scale: float
    sliding_window: int | None
    q_norm: RMSNorm | None  # per-head q/k norms before rotary (Qwen3)
    k_norm: RMSNorm | None


def _plain_layer(layer) -> _Layer | None:
    from .decoder import DecoderLayer

    if type(layer) is not DecoderLayer or not layer._fuses_decode:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if (type(attn) is not Attention or attn.soft_cap is not None
            or (attn.q_norm is not None and not _per_head_norms(attn))
            or not attn.rotary.is_neox_style or type(mlp) is not GatedMLP or mlp.act_and_mul is not kernels.silu_and_mul
            or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm):
        return None
    return _Layer(layer.input_layernorm, layer.post_attention_layernorm, attn.qkv_proj, attn.o_proj,
                  mlp.gate_up_proj, mlp.down_proj, attn.rotary, attn.qkv_proj.num_heads_per_rank,
                  attn.qkv_proj.num_kv_heads_per_rank, attn.scale, attn.sliding_window, attn.q_norm, attn.k_norm)


def _per_head_norms(attn) -> bool:
    """RMSNorm q and k norms over one head each, as ``qk_norm_rope_and_cache`` applies them."""
    return all(type(norm) is RMSNorm and norm.weight.shape == (attn.head_dim,) for norm in (attn.q_norm, attn.k_norm))


def _plain_layers(model) -> list[_Layer] | None:
    """The layers' parts when every layer qualifies, else None; once per model."""
    layers = model.__dict__.get("_cpu_step_layers", False)
    if layers is False:
        parts = [_plain_layer(layer) for layer in model.layers]
        layers = None if any(part is None for part in parts) else parts
        model.__dict__["_cpu_step_layers"] = layers
    return layers


def run_layers(model, hidden: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
    """``(hidden, residual)`` after all of ``model``'s layers, or None where this path does not take
    the step (see the module docstring); then the caller runs the layers itself."""
    if (not ENABLED or hidden.device.type != "cpu" or hidden.dim() != 2 or meta.max_query_len > MAX_QUERY_ROWS
            or meta.flash_prefill is not None or not cpu_step_native.available()):
        return None
    layers = _plain_layers(model)
    if layers is None:
        return None
    dtype = hidden.dtype
    key_cache, value_cache = kv_caches[0]
    first = layers[0]
    if (first.input_norm.weight.dtype != dtype or (first.q_norm is not None and first.q_norm.weight.dtype != dtype)
            or not hidden.is_contiguous() or not cpu_step_native.supports_rope_cache_attention(
            hidden.new_empty(0, 0), first.rotary.cos_sin_cache, key_cache, value_cache, key_cache.shape[-1])
            or meta.max_context_len > meta.block_tables.shape[1] * key_cache.shape[1]):
        return None
    step = cpu_step_native.AttentionStep.of(positions, meta.slot_mapping, meta.query_start_loc, meta.context_lens,
                                            meta.block_tables, key_cache.shape, first.rotary.cos_sin_cache.shape[0])
    if step is None:
        return None
    if hidden.shape[0] <= gguf_cpu_native.MAX_ROWS and NATIVE_LAYERS:
        native = _native_layers(model, layers)
        if native is not None:
            return native.run(hidden, step, kv_caches)
    rms_norm, silu_and_mul, attend = cpu_step_native.rms_norm, cpu_step_native.silu_and_mul, step.attend
    # The norms update the residual in place and write their rows into one buffer, which each
    # projection reads before the next norm runs; so do the attention and SwiGLU (their matmul reads them).
    residual, normed = torch.empty_like(hidden), torch.empty_like(hidden)
    heads = act = None
    has_residual = False
    for layer, (key_cache, value_cache) in zip(layers, kv_caches):
        norm = layer.input_norm
        rms_norm(hidden, norm.weight, norm.eps, residual if has_residual else None, out=normed, sum_out=residual)
        has_residual = True
        qkv = _same_dtype(layer.qkv_proj.forward(normed), dtype)
        if layer.q_norm is not None:
            _norm_heads(qkv, layer)
        heads = attend(qkv, layer.rotary.cos_sin_cache, key_cache, value_cache, layer.num_heads, layer.num_kv_heads,
                       layer.scale, layer.sliding_window, heads)
        hidden = _same_dtype(layer.o_proj.forward(heads), dtype)
        norm = layer.post_norm
        rms_norm(hidden, norm.weight, norm.eps, residual, out=normed, sum_out=residual)
        gate_up = layer.gate_up_proj.forward(normed)
        act = silu_and_mul(gate_up.contiguous(), act)
        hidden = _same_dtype(layer.down_proj.forward(act), dtype)
    return hidden, residual


def _native_layers(model, layers: list[_Layer]) -> cpu_step_native.DecoderLayers | None:
    """All of ``model``'s layers as one C call where every linear runs the GGUF C GEMVs (the linear
    method's ``cpu_step_runs``); else None. Once per model."""
    native = model.__dict__.get("_cpu_step_native", False)
    if native is False:
        native = None
        weights = [_layer_weights(layer, layers[0].input_norm.weight.dtype) for layer in layers]
        if all(spec is not None for spec in weights):
            native = cpu_step_native.DecoderLayers.of(weights)
        model.__dict__["_cpu_step_native"] = native
    return native


def _layer_weights(layer: _Layer, dtype: torch.dtype) -> cpu_step_native.LayerWeights | None:
    linears = []
    for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        method = getattr(linear, "method", None)
        if method is None or linear.parallel.size != 1 or linear.routine is None:
            return None
        if linear.routine is not getattr(linear, "method_routine", None):
            # a routine swapped in later (LoRA, cpu_int8_activations): the step must run that; the int8
            # routine says which kernel and panels it runs (gguf_linear_method._int8_routine)
            runs = getattr(linear.routine, "step_runs", None)
        else:
            runs = method.cpu_step_runs(linear, dtype)
        if runs is None:
            return None
        linears.append((runs, linear.bias))
    norms = [None, None]
    if layer.q_norm is not None:
        norms = [(norm.weight, norm.eps) for norm in (layer.q_norm, layer.k_norm)]
    return cpu_step_native.LayerWeights(
        layer.input_norm.weight, layer.post_norm.weight, layer.input_norm.eps, layer.post_norm.eps, *linears,
        layer.rotary.cos_sin_cache, layer.num_heads, layer.num_kv_heads, layer.qkv_proj.head_dim, layer.scale,
        layer.sliding_window, *norms)


def _norm_heads(qkv: torch.Tensor, layer: _Layer) -> None:
    """RMS-norm each query and key head of ``qkv`` in place (before the attention call rotates them);
    row by row in C, so a head's bits do not depend on how many rows the step has."""
    head_dim = layer.q_norm.weight.shape[0]
    num_tokens, query_width = qkv.shape[0], layer.num_heads * head_dim
    key_width = layer.num_kv_heads * head_dim
    for norm, part in ((layer.q_norm, qkv[:, :query_width]), (layer.k_norm, qkv[:, query_width:query_width + key_width])):
        heads = part.reshape(-1, head_dim)  # a copy unless the step has one row
        normed, _ = cpu_step_native.rms_norm(heads.contiguous(), norm.weight, norm.eps)
        part.copy_(normed.view(num_tokens, -1))


def _same_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)
