"""Batch-size-1 decode on CUDA: the RMSNorm before a projection and the SwiGLU before ``down_proj``
run inside the matmul (``kernels/gemv``), three launches fewer per layer, and ``o_proj`` by the same
GEMV (cuBLAS is slow on it at one row).

A one-row step reads every weight once and is otherwise bound by its ~10 launches a layer; a
Triton GEMV that recomputes the norm (or the activation) of its one row in every program replaces
two kernels by one. It applies only where the result is the unfused one's: a dense weight
(``DENSE`` method, or a wrapper that names one and finishes the product, LoRA's ``fused_decode_weight``
and ``finish_fused_decode``; a quantized method may bring its own fused kernels instead, FP8's
``fused_rms_norm_linear`` and ``fused_silu_and_mul_linear``), no bias, a single process, CUDA
tensors, at most :data:`MAX_ROWS` rows; and where it is faster, a weight of at most
:data:`MAX_WEIGHT_NUMEL` elements. Everything else takes the unfused ops, which are also the
reference (``kernels/gemv/reference.py``).

>>> qkv, residual = norm_and_linear(layer.input_layernorm, hidden, residual, layer.self_attn.qkv_proj)
>>> out, residual = norm_and_mlp(layer.post_attention_layernorm, layer.mlp, hidden, residual)
"""
from __future__ import annotations

import torch

from hearth_llm import kernels
from hearth_llm.kernels.lazy_triton import triton_module

from .linear_method import DENSE

# Rows a fused matmul takes; more rows go to the unfused ops (cuBLAS reads the weight once for all).
MAX_ROWS = 1
# Off: every step takes the unfused ops (benchmarks A/B it; graphs captured after a change follow it).
ENABLED = True
# Weights up to this many elements take the GEMV; bigger ones read faster through cuBLAS even with the
# norm or SwiGLU launch saved (H200, one row, µs in CUDA graphs: Llama-3-8B gate_up 28672x4096
# 63.6 fused against 58.5 for RMSNorm + cuBLAS, down 4096x14336 34.0 against 33.5; at and below
# 6144x4096 the GEMV wins: qkv 16.3 against 19.1, o_proj 10.8 against 13.5; Qwen3-0.6B's all win).
# The SwiGLU-epilogue MLP (:data:`SWIGLU_EPILOGUE`) takes weights of any size.
MAX_WEIGHT_NUMEL = 1 << 25
# o_proj by the Triton GEMV too (no prologue to fuse: it simply beats cuBLAS at one row, Qwen3-0.6B's
# 1024x2048 3.4 µs against 12.7, which runs it at 331 GB/s).
PLAIN_GEMV = True
# SwiGLU as gate_up's epilogue (the matmul writes silu(gate) * up; down_proj is then a plain GEMV),
# instead of down_proj's prologue, which re-reads the whole gate_up row in every program; for dense
# layers of any size (H200 round 1, 2026-12-02, decode graph with PDL: Llama-3-8B 4.068 ms against
# 4.094 with gate_up/down on cuBLAS and 4.491 with them on the prologue GEMVs; Qwen3-0.6B 0.685
# against 0.725; `python -m hearth_llm.benchmarks.bs1_decode --parts engine`).
SWIGLU_EPILOGUE = True
# The LM head by the Triton GEMV too, for one row (H200 round 1, PDL on: Llama-3-8B's 1.05 GB in
# 233.5 µs, 4.50 TB/s, against cuBLAS's 243.3; Qwen3-0.6B's 0.31 GB 77.0 against 75.4).
LM_HEAD_GEMV = True
# Devices whose tensors take the fused kernels; tests add "cpu" to run them in the Triton interpreter.
DEVICE_TYPES = frozenset({"cuda"})


def _gemv():
    return triton_module("hearth_llm.kernels.gemv")


def _takes_gemv(x: torch.Tensor) -> bool:
    return ENABLED and x.device.type in DEVICE_TYPES and x.dim() == 2 and x.shape[0] <= MAX_ROWS


def _usable(weight, x: torch.Tensor, max_numel: float) -> torch.Tensor | None:
    if weight is None or weight.device != x.device or weight.dtype != x.dtype or weight.numel() > max_numel:
        return None
    return weight if _gemv() is not None else None


def dense_weight(layer, x: torch.Tensor) -> torch.Tensor | None:
    """The weight a fused kernel may multiply ``x`` by, or None where the unfused path must run."""
    if not _takes_gemv(x):
        return None
    if layer.bias is not None or layer.parallel.size != 1:
        return None
    if layer.method is not DENSE:  # a wrapper adding to a dense product (LoRA) names the weight, or None
        weight_for = getattr(layer.method, "fused_decode_weight", None)
        # (any size where the MLP's big weights go through GEMVs: a LoRA MLP cannot take the epilogue)
        limit = float("inf") if SWIGLU_EPILOGUE else MAX_WEIGHT_NUMEL
        return None if weight_for is None else _usable(weight_for(layer, x), x, limit)
    return _usable(getattr(layer, "weight", None), x, MAX_WEIGHT_NUMEL)


def _plain_dense_weight(layer, x: torch.Tensor) -> torch.Tensor | None:
    """A DENSE layer's weight for the SwiGLU-epilogue MLP: as :func:`dense_weight`, of any size."""
    if not _takes_gemv(x) or layer.bias is not None or layer.parallel.size != 1:
        return None
    return _usable(getattr(layer, "weight", None), x, float("inf"))


def _method_fusion(layer, name: str, *args):
    """A quantized method's own one-row kernel with the op before the matmul fused in (FP8's
    ``fused_rms_norm_linear`` / ``fused_silu_and_mul_linear``): its result, or None where the
    method has none or declines this call."""
    fuse = getattr(layer.method, name, None)
    return None if fuse is None else fuse(layer, *args)


def _finished(layer, out: torch.Tensor) -> torch.Tensor:
    """The layer's output from the GEMV's product (a wrapper's weight may carry extra rows: LoRA's shrink)."""
    finish = getattr(layer.method, "finish_fused_decode", None)
    return out if finish is None else finish(out)


def norm_and_linear(norm, x: torch.Tensor, residual: torch.Tensor | None, layer):
    """``(layer(norm(x + residual)), x + residual)``; ``norm`` an RMSNorm (LayerNorms run unfused)."""
    from .norms import RMSNorm

    if type(norm) is RMSNorm and _takes_gemv(x):
        fused = _method_fusion(layer, "fused_rms_norm_linear", x, residual, norm.weight, norm.eps)
        if fused is not None:
            return fused
    weight = dense_weight(layer, x) if type(norm) is RMSNorm else None
    if weight is not None:
        out, summed = _gemv().rms_norm_linear(x, residual, norm.weight, norm.eps, weight)
        return _finished(layer, out), summed
    if residual is None:
        return layer(norm(x)), x
    normed, residual = norm(x, residual)
    return layer(normed), residual


def act_and_down(mlp, gate_up: torch.Tensor) -> torch.Tensor:
    """``mlp.down_proj(mlp.act_and_mul(gate_up))`` for a GatedMLP; SwiGLU fused into the matmul."""
    if mlp.act_and_mul is kernels.silu_and_mul and _takes_gemv(gate_up):
        fused = _method_fusion(mlp.down_proj, "fused_silu_and_mul_linear", gate_up)
        if fused is not None:
            return fused
    weight = dense_weight(mlp.down_proj, gate_up) if mlp.act_and_mul is kernels.silu_and_mul else None
    if weight is not None:
        return _finished(mlp.down_proj, _gemv().silu_and_mul_linear(gate_up, weight))
    return mlp.down_proj(mlp.act_and_mul(gate_up))


def _is_plain(op, plain) -> bool:
    """``op`` is ``plain``, or a wrapper that is exactly ``plain`` on this step (``is_plain_now``: LoRA's on a
    step without adapters)."""
    return op is plain or getattr(op, "is_plain_now", False)


def norm_and_mlp(norm, mlp, x: torch.Tensor, residual: torch.Tensor | None):
    """``(mlp(norm(x + residual)), x + residual)`` for a GatedMLP: with :data:`SWIGLU_EPILOGUE`,
    RMSNorm + gate_up + SwiGLU in one GEMV and down_proj in another; else :func:`norm_and_linear`
    and :func:`act_and_down`."""
    from .norms import RMSNorm

    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    if SWIGLU_EPILOGUE and type(norm) is RMSNorm and mlp.act_and_mul is kernels.silu_and_mul and _takes_gemv(x):
        fused = _method_fusion(gate_up, "fused_rms_norm_linear_silu_and_mul", x, residual, norm.weight, norm.eps)
        if fused is not None:  # a quantized method's own kernel (AWQ/GPTQ on CUDA)
            return linear(down, fused[0]), fused[1]
    if (SWIGLU_EPILOGUE and type(norm) is RMSNorm and _is_plain(mlp.act_and_mul, kernels.silu_and_mul)
            and _is_plain(gate_up.method, DENSE) and _is_plain(down.method, DENSE)):  # (not LoRA adding an update)
        gate_up_weight, down_weight = _plain_dense_weight(gate_up, x), _plain_dense_weight(down, x)
        if gate_up_weight is not None and down_weight is not None:
            act, residual = _gemv().rms_norm_linear_silu_and_mul(x, residual, norm.weight, norm.eps, gate_up_weight)
            return _gemv().linear(act, down_weight), residual
    gate_up, residual = norm_and_linear(norm, x, residual, mlp.gate_up_proj)
    return act_and_down(mlp, gate_up), residual


def linear(layer, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; by the Triton GEMV when :data:`PLAIN_GEMV` is on and the layer qualifies."""
    weight = dense_weight(layer, x) if PLAIN_GEMV else None
    if weight is not None:
        return _finished(layer, _gemv().linear(x, weight))
    return layer(x)


def lm_head(head, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)``; by the Triton GEMV when :data:`LM_HEAD_GEMV` is on and ``head`` is a plain
    bias-free ``nn.Linear`` (a vocabulary-parallel or quantized head keeps its own forward)."""
    weight = None
    if LM_HEAD_GEMV and type(head) is torch.nn.Linear and head.bias is None and _takes_gemv(hidden):
        weight = _usable(head.weight, hidden, float("inf"))
    if weight is not None:
        return _gemv().linear(hidden, weight)
    return head(hidden)
