"""Plain torch: a layer's attention inputs from its fused projection, as the single reference ops
compose them; the fused Triton kernel is tested against this composition."""
from __future__ import annotations

import torch

from ..kv_cache import reference as kv_cache
from ..norm import reference as norm
from ..rotary import reference as rotary


def qk_norm_rope_and_cache(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                           num_kv_heads, q_norm_weight=None, k_norm_weight=None, eps=1e-6, is_neox_style=True,
                           kv_scales=None, *, rms_norm=norm.rms_norm, rotary_embedding=rotary.rotary_embedding,
                           write_kv_cache=kv_cache.write_kv_cache) -> torch.Tensor:
    """Split ``qkv`` ``[T, (H + 2 Hkv) * D]`` into heads, RMS-norm the query and key heads (when
    the norm weights are given), rotate them, store keys and values at ``slot_mapping``; returns
    the queries ``[T, H, D]``. An fp8 cache stores them quantized with ``kv_scales`` (see
    ``kv_cache.reference.write_kv_cache``). The keyword-only ops let ``kernels`` compose its dispatched ones."""
    head_dim = key_cache.shape[-1]
    num_tokens = qkv.shape[0]
    query, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    query = query.view(num_tokens, num_heads, head_dim)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        query, _ = rms_norm(query, q_norm_weight, eps)
        key, _ = rms_norm(key, k_norm_weight, eps)
    query, key = rotary_embedding(query, key, positions, cos_sin_cache, is_neox_style)
    if kv_scales is None:
        write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    else:
        write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_scales)
    return query
