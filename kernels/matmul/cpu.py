"""CPU: matmuls against weights repacked for the CPU's fast kernels.

- oneDNN-prepacked bf16 (``pack_dense_weight`` / ``dense_linear``): ``F.linear`` would reorder a
  plain bf16 weight on every call.
- fbgemm's packed fp16 (``pack_fp16_weight`` / ``fp16_linear``): reads memory fastest for a few
  rows against a wide weight (the vocabulary projection).
- 4-bit group-quantized (``int4_weight_if_lossless`` / ``int4_linear``): used only where it is
  lossless, e.g. for weights that came from a Q4 GGUF file.

The format objects in ``formats.py`` wrap these; ``kernels.linear`` picks the routine. The
``*_routine`` functions bind a weight once (``kernels.linear_routine``): a decode step then makes
one Python call per matmul instead of a dispatch.
"""
from __future__ import annotations

import torch

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


def dense_linear_routine(packed_weight: torch.Tensor, bias: torch.Tensor | None = None):
    """:func:`dense_linear` with its weight and bias bound: ``routine(x)``, one Python call a step."""
    linear_pointwise = torch.ops.mkldnn._linear_pointwise.default
    return lambda x: linear_pointwise(x, packed_weight, bias, "none", [], "")


def fp16_linear_routine(packed, bias: torch.Tensor | None = None):
    """:func:`fp16_linear` (plus ``bias``) with its weight bound: ``routine(x)``."""
    linear_fp16 = torch.ops.quantized.linear_dynamic_fp16.default
    if bias is None:
        return lambda x: linear_fp16(x.float(), packed)
    return lambda x: linear_fp16(x.float(), packed).add_(bias)


def int4_linear_routine(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = INT4_GROUP_SIZE,
                        bias: torch.Tensor | None = None):
    """:func:`int4_linear` with its weight and bias bound: ``routine(x)``."""
    int4pack_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default
    if bias is None:
        return lambda x: int4pack_mm(x, packed, group_size, scales_and_zeros)
    return lambda x: int4pack_mm(x, packed, group_size, scales_and_zeros).add_(bias)


def int4_or_dense_linear_routine(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                                 dense_packed_weight: torch.Tensor, bias: torch.Tensor | None, max_int4_rows: int):
    """``routine(x)``: the int4 kernel for inputs of at most ``max_int4_rows`` rows (bound by reading
    the weight: a quarter of the bytes), oneDNN's bf16 one (``dense_packed_weight``, the same
    values) for more, where the int4 kernel's unpacking costs more than its reads save."""
    int4pack_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default
    linear_pointwise = torch.ops.mkldnn._linear_pointwise.default

    def routine(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= max_int4_rows:
            out = int4pack_mm(x, packed, group_size, scales_and_zeros)
            return out if bias is None else out.add_(bias)
        return linear_pointwise(x, dense_packed_weight, bias, "none", [], "")

    return routine


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                group_size: int = INT4_GROUP_SIZE, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight from :func:`int4_weight_if_lossless`; ``x`` is bf16 ``[M, K]``."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
    return out if bias is None else out.add_(bias)
