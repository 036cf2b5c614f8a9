"""Attention over packed texts of different lengths in one call: flash attention's variable-length
kernel (``torch.ops.aten._flash_attention_forward`` with cumulative sequence lengths, what torch's
nested-tensor SDPA runs), on CUDA in float16/bfloat16.

Without it, :func:`~.bert.packed_attention` runs one SDPA per run of equal-length texts: a batch of
passages with many distinct lengths costs as many calls per layer, each with its own copy out. With
it, a batch costs one call per layer, reads query, key and value straight from the fused projection
and writes the output already packed: no padding, no mask, no copies. The CPU, float32 (the exact
path) and shapes flash cannot take keep the per-run SDPA.

A batch whose texts all have one length (long passages cut at ``max_seq_length``) goes to cuDNN's
fused attention instead (the op of SDPA's cuDNN backend on ``[texts, heads, length, head_dim]``
views of the same projection): on the H200, 64 texts of 256 tokens, 16 heads of 64, it took 60 us per layer
where flash's variable-length kernel took 98 (the encoder's forward pass 1.8 % less).

>>> out = attend(query, key, value, cu_seqlens, max_length)   # [num_tokens, heads, head_dim] each
>>> out = attend_equal_lengths(qkv, num_texts, length, num_heads)   # [num_tokens, width], or None
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("hearth_llm")

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_is_broken = False    # set when the kernel refused a call: the per-run path is used from then on
_is_cudnn_broken = False   # the same for attend_equal_lengths


def can_run(qkv: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`attend` can take this packed projection (CUDA, half precision, a head size
    flash supports, the op in this torch build, flash SDPA not switched off)."""
    return (not _is_broken and qkv.is_cuda and qkv.dtype in _HALF_DTYPES and head_dim % 8 == 0 and head_dim <= 256
            and hasattr(torch.ops.aten, "_flash_attention_forward") and torch.backends.cuda.flash_sdp_enabled())


def attend_equal_lengths(qkv: torch.Tensor, num_texts: int, length: int, num_heads: int) -> torch.Tensor | None:
    """Attention for ``num_texts`` texts of ``length`` tokens each, packed in the fused projection
    ``qkv`` ``[num_texts * length, 3 * width]`` (CUDA, half precision) → ``[num_texts * length,
    width]``, through cuDNN's fused attention; None where cuDNN cannot take it (SDPA's own check
    says no, or it refused a call: then :func:`attend` runs, after a refusal from then on)."""
    global _is_cudnn_broken
    if _is_cudnn_broken:
        return None
    query, key, value = qkv.view(num_texts, length, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    if not _cudnn_takes(query, key, value):
        return None
    try:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, None, False)[0]
    except RuntimeError as error:
        logger.warning("cuDNN attention unavailable (%s); flash's variable-length kernel runs", error)
        _is_cudnn_broken = True
        return None
    return out.transpose(1, 2).reshape(qkv.shape[0], -1)


def _cudnn_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """SDPA's own check for its cuDNN backend (shapes, strides, dtype, GPU, and
    ``torch.backends.cuda.enable_cudnn_sdp``). The op is called directly rather than through
    ``sdpa_kernel``, whose backend switches are process-wide: another thread's attention (or a
    second engine's) could run, or be refused, under them."""
    try:
        params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, False, False)
        return torch.backends.cuda.can_use_cudnn_attention(params, False)
    except (AttributeError, TypeError, RuntimeError):    # a torch without this check
        return False


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
           max_length: int) -> torch.Tensor | None:
    """``[num_tokens, heads, head_dim]`` each (any strides with the last one 1), texts packed one after
    another as ``cu_seqlens`` (int32 ``[num_texts + 1]``) says → the attention output, same shape,
    each token attending to every token of its own text (no causal mask, scale ``1/sqrt(head_dim)``);
    None if the kernel refused the call (then :func:`can_run` says no from then on)."""
    global _is_broken
    try:
        return torch.ops.aten._flash_attention_forward(query, key, value, cu_seqlens, cu_seqlens, max_length,
                                                       max_length, 0.0, False, False)[0]
    except RuntimeError as error:    # refused up front (a build or GPU without it); nothing ran
        logger.warning("variable-length flash attention unavailable (%s); attention runs per run of "
                       "equal-length texts", error)
        _is_broken = True
        return None
