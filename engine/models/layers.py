"""Layers shared by every decoder model: norms, rotary, attention over the paged cache, MLP."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hearth_llm import kernels

from .arch import ArchConfig


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache; built once per step by the model runner."""

    slot_mapping: torch.Tensor      # [T] flat cache slot of each new token
    block_tables: torch.Tensor      # [B, max_blocks] block ids of each sequence
    context_lens: torch.Tensor      # [B] tokens in cache after this step
    query_start_loc: torch.Tensor   # [B + 1] where each sequence's new tokens start in the flat batch
    max_query_len: int
    max_context_len: int


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without a residual returns the normed tensor; with one, ``(normed, x + residual)``."""
        normed, summed = kernels.rms_norm(x, self.weight, self.eps, residual)
        return normed if residual is None else (normed, summed)


class RotaryEmbedding(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        positions = torch.arange(arch.max_position_embeddings, dtype=torch.float32, device=arch.rope_inv_freq.device)
        freqs = torch.outer(positions, arch.rope_inv_freq.float())
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * arch.rope_attention_scaling
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions, query, key):
        return kernels.rotary_embedding(query, key, positions, self.cos_sin_cache)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = arch.sliding_window_for(layer_index)
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.rotary = rotary
        if arch.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions, hidden, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = self.rotary(positions, query, key)
        key_cache, value_cache = kv_cache
        kernels.write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        out = kernels.paged_attention(
            query, key_cache, value_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
            meta.max_query_len, meta.max_context_len, self.scale, self.sliding_window,
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_index, rotary)
        self.mlp = GatedMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
