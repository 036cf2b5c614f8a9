"""llama.cpp's block formats in plain torch: the reference every GGUF kernel is tested against.

A ``[N, K]`` weight is stored as ``N`` rows of ``K / block_size`` blocks, each ``type_size`` bytes
(``BLOCK_FORMATS``). :func:`dequantize` turns such rows (uint8 ``[N, K / block_size *
type_size]``) into float32 values with the same float32 operations in the same order as
``gguf.quants.dequantize`` (gguf-py, llama.cpp's own Python reference), so the results are
bit-equal to it. :func:`gguf_linear` is ``x @ W.T + bias`` through that.

Block layouts (little-endian; ``d``/``m``/``dmin`` are float16):

- ``Q4_0`` (32, 18 B): ``d``, 16 bytes of codes: byte ``j`` holds element ``j`` (low nibble) and
  ``j + 16`` (high); ``w = d * (q - 8)``.
- ``Q4_1`` (32, 20 B): ``d``, ``m``, codes as Q4_0; ``w = d * q + m``.
- ``Q5_0`` (32, 22 B): ``d``, ``qh`` (32 high bits, bit ``j`` for element ``j``), low nibbles as
  Q4_0; ``w = d * (q - 16)``.
- ``Q5_1`` (32, 24 B): ``d``, ``m``, ``qh``, nibbles; ``w = d * q + m``.
- ``Q8_0`` (32, 34 B): ``d``, 32 int8; ``w = d * q``.
- ``Q4_K`` (256, 144 B): ``d``, ``dmin``, 12 bytes of eight 6-bit scales and mins, 128 bytes of
  codes: 32-byte chunk ``c`` holds sub-block ``2c`` in its low nibbles and ``2c + 1`` in its high
  ones; ``w = (d * sc[s]) * q - dmin * mn[s]`` for sub-block ``s`` of 32.
- ``Q5_K`` (256, 176 B): as Q4_K with 32 bytes of high bits before the codes (bit ``s`` of
  byte ``l`` for element ``32 s + l``).
- ``Q6_K`` (256, 210 B): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, ``d`` last;
  ``w = (d * sc[j // 16]) * (q - 32)``.

One format of our own joins them: ``W4G128`` (128, 68 B), the exact repacking of AWQ/GPTQ 4-bit
weights with groups of 128 (``engine/models/quant/awq_gptq.py``): float16 scale ``s``, uint8 zero
point ``z``, a pad byte, 64 bytes of codes (byte ``j``: element ``j`` low, ``j + 64`` high);
``w = s * (q - z)``.

>>> rows = quantize(torch.randn(4, 256), "Q8_0")       # uint8 [4, 8 * 34]
>>> dequantize(rows, "Q8_0").shape
torch.Size([4, 256])
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """One llama.cpp block type: ``block_size`` values in ``type_size`` bytes."""

    name: str
    block_size: int
    type_size: int

    def row_bytes(self, num_columns: int) -> int:
        return num_columns // self.block_size * self.type_size

    def num_columns(self, row_bytes: int) -> int:
        return row_bytes // self.type_size * self.block_size


BLOCK_FORMATS = {f.name: f for f in (
    BlockFormat("Q4_0", 32, 18), BlockFormat("Q4_1", 32, 20), BlockFormat("Q5_0", 32, 22),
    BlockFormat("Q5_1", 32, 24), BlockFormat("Q8_0", 32, 34), BlockFormat("Q4_K", 256, 144),
    BlockFormat("Q5_K", 256, 176), BlockFormat("Q6_K", 256, 210), BlockFormat("W4G128", 128, 68))}
# llama.cpp's types among them (W4G128 is ours).
GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def block_format(quant_type: str) -> BlockFormat:
    """The format named ``quant_type``; ValueError naming the supported ones otherwise."""
    try:
        return BLOCK_FORMATS[quant_type]
    except KeyError:
        raise ValueError(f"block quantization type {quant_type!r} is not supported; supported: "
                         f"{sorted(BLOCK_FORMATS)}") from None


def dequantize(data: torch.Tensor, quant_type: str) -> torch.Tensor:
    """float32 ``[N, K]`` values of uint8 block rows ``data`` ``[N, row_bytes]`` (bit-equal to gguf-py)."""
    fmt = block_format(quant_type)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % fmt.type_size:
        raise ValueError(f"{quant_type} data must be uint8 rows of whole {fmt.type_size}-byte blocks, got "
                         f"{data.dtype} {tuple(data.shape)}")
    num_rows = data.shape[0]
    blocks = data.contiguous().view(-1, fmt.type_size)
    values = _DEQUANTIZERS[quant_type](blocks)
    return values.reshape(num_rows, fmt.num_columns(data.shape[1]))


def gguf_linear(x: torch.Tensor, data: torch.Tensor, quant_type: str, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` dequantized whole (float32, then ``x``'s dtype)."""
    return F.linear(x, dequantize(data, quant_type).to(x.dtype), bias)


def pack_w4g128(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``W4G128`` rows from codes (0..15, ``[N, K]``), float16 scales and zero points (``[N, K / 128]``)."""
    num_rows, num_columns = codes.shape
    groups = codes.to(torch.uint8).reshape(num_rows, num_columns // 128, 2, 64)
    packed = groups[:, :, 0] | (groups[:, :, 1] << 4)                              # [N, G, 64]
    header = torch.zeros(num_rows, num_columns // 128, 4, dtype=torch.uint8, device=codes.device)
    # flatten first: a [N, 1] tensor can be "contiguous" with a last stride of N, which view() refuses
    header[..., 0:2] = scales.to(torch.float16).reshape(-1).contiguous().view(torch.uint8).reshape(num_rows, -1, 2)
    header[..., 2] = zeros.to(torch.uint8)
    return torch.cat((header, packed), dim=-1).reshape(num_rows, -1)


def quantize(weight: torch.Tensor, quant_type: str) -> torch.Tensor:
    """uint8 block rows of a float ``[N, K]`` weight, by gguf-py's quantizer (tests build weights
    with it; it covers Q4_0..Q8_0, not the K-quants, which need llama.cpp or hand-built blocks)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    rows = gguf_quantize(weight.float().numpy(), GGMLQuantizationType[quant_type])
    return torch.from_numpy(rows.copy())


# --- per format, on a [num_blocks, type_size] uint8 view ---------------------------------------


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()  # [B, 1]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` bytes -> ``[B, 2 n]``: all low nibbles, then all high ones."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """``[B, 4]`` bytes of a little-endian uint32 -> ``[B, 32]`` bits, bit ``j`` at column ``j``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, :, None] >> shifts) & 1).reshape(packed.shape[0], 32)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def k_scales_and_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of Q4_K/Q5_K from their 12 bytes ``[B, 12]`` -> 2 x ``[B, 8]``."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_scale_terms(b):
    sc, mn = k_scales_and_mins(b[:, 4:16])
    return (_f16(b, 0) * sc.float())[..., None], (_f16(b, 2) * mn.float())[..., None]  # [B, 8, 1]


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K codes ``[B, 128]`` -> ``[B, 8, 32]``: chunk ``c`` low nibbles, then its high ones."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return torch.cat((chunks & 0x0F, chunks >> 4), dim=2).reshape(-1, 8, 32)


def _q4_k(b):
    scale, minimum = _k_scale_terms(b)
    return (scale * _k_nibbles(b[:, 16:]).float() - minimum).reshape(-1, 256)


def _q5_k(b):
    scale, minimum = _k_scale_terms(b)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> shifts) & 1
    q = _k_nibbles(b[:, 48:]) | (high << 4)
    return (scale * q.float() - minimum).reshape(-1, 256)


def _q6_k(b):
    low = b[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat((low & 0x0F, low >> 4), dim=2).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    scale = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float())[..., None]  # [B, 16, 1]
    return (scale * q).reshape(-1, 256)


def _w4g128(b):
    return _f16(b, 0) * (_nibbles(b[:, 4:]).to(torch.int16) - b[:, 2:3].to(torch.int16)).float()


_DEQUANTIZERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
                 "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "W4G128": _w4g128}
