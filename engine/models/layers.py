"""The shared layers under their old import path; each now lives in a file of its own."""
from __future__ import annotations

from .attention import Attention, AttentionMetadata
from .cpu_weights import CpuLinear, CpuLogitsHead, cpu_logits_head
from .decoder import DecoderLayer
from .mlp import MLP, GatedMLP
from .norms import LayerNorm, RMSNorm
from .rotary import RotaryEmbedding

__all__ = ["Attention", "AttentionMetadata", "CpuLinear", "CpuLogitsHead", "cpu_logits_head", "DecoderLayer", "MLP",
           "GatedMLP", "LayerNorm", "RMSNorm", "RotaryEmbedding"]
