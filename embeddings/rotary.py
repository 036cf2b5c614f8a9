"""Rotary position embeddings and windowed attention on packed tokens, for the rotary encoders
(NomicBert, ModernBERT).

The encoders keep BERT's packed layout (:class:`~.bert.PackedLayout`): dense layers on the real
tokens only, attention once per run of equal-length texts. Rotary embeddings need each token's
position inside its own text, which right padding makes ``0 .. length - 1`` per text.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .bert import PackedLayout


def inverse_frequencies(head_dim: int, base: float) -> torch.Tensor:
    """``1 / base^(2i / head_dim)``: the rotation speed of each pair of channels (the "default" rope type)."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def packed_positions(layout: PackedLayout, device: torch.device) -> torch.Tensor:
    """``[num_tokens]``: each packed token's position within its text."""
    positions = torch.arange(layout.length, device=device).expand(layout.batch, layout.length).reshape(-1)
    return layout.pack(positions)


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin ``[num_tokens, head_dim]`` in the half-split layout (channel i pairs with i + head_dim / 2)."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [num_tokens, heads, head_dim]`` rotated by the tables of :func:`rotary_tables`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def band_mask(length: int, half_window: int, device: torch.device) -> torch.Tensor:
    """``[length, length]`` True where ``|query - key| <= half_window`` (ModernBERT's local attention)."""
    index = torch.arange(length, device=device)
    return (index[:, None] - index[None, :]).abs() <= half_window


def packed_rotary_attention(qkv: torch.Tensor, layout: PackedLayout, num_heads: int, cos: torch.Tensor,
                            sin: torch.Tensor, half_window: int | None = None) -> torch.Tensor:
    """``[num_tokens, 3 * width]`` packed query, key and value → ``[num_tokens, width]``: rotary
    embeddings on query and key, then one attention per run of equal-length texts; with
    ``half_window``, each token sees only keys within that distance."""
    num_tokens, width = qkv.shape[0], qkv.shape[1] // 3
    head_dim = width // num_heads
    qkv = qkv.view(num_tokens, 3, num_heads, head_dim)
    query, key = apply_rotary(qkv[:, 0], cos, sin), apply_rotary(qkv[:, 1], cos, sin)
    value = qkv[:, 2]
    attended = qkv.new_empty(num_tokens, width)
    for start, num_texts, length in layout.runs:
        end = start + num_texts * length
        q, k, v = (part[start:end].view(num_texts, length, num_heads, head_dim).transpose(1, 2)
                   for part in (query, key, value))
        mask = None if half_window is None or half_window >= length - 1 else band_mask(length, half_window, qkv.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)        # [texts, heads, length, head_dim]
        attended[start:end].view(num_texts, length, num_heads, head_dim).copy_(out.transpose(1, 2))
    return attended
