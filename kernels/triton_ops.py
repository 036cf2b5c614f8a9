"""Every op's Triton kernel under one name (each lives in its op's ``triton_<op>.py``), with the
signature and semantics of its torch reference.

Importing this module needs Triton but no GPU, so CI can import it and the tests can run the
kernels on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` before import).

>>> from hearth_llm.kernels import triton_ops
>>> triton_ops.silu_and_mul(torch.randn(4, 256, device="cuda")).shape
torch.Size([4, 128])
"""
from __future__ import annotations

import torch  # noqa: F401  (the doctest)

from .activation.triton_activation import gelu, gelu_and_mul, silu_and_mul
from .attention.triton_attention import (DECODE_MIN_PARTITION_SIZE, DEFAULT_LAUNCH, PREFILL_BLOCK_M,
                                         PREFILL_BLOCK_N, PREFILL_NUM_STAGES, PREFILL_NUM_WARPS, DecodeLaunch,
                                         paged_attention)
from .attention_inputs.triton_attention_inputs import qk_norm_rope_and_cache, supports_fused_rotary
from .kv_cache.triton_kv_cache import write_kv_cache
from .norm.triton_norm import layer_norm, rms_norm
from .rotary.triton_rotary import rotary_embedding
from .sampling.triton_sampling import SAMPLER_TARGET_PROGRAMS, sample_from_logits

__all__ = [
    "write_kv_cache",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu",
    "layer_norm",
    "qk_norm_rope_and_cache",
    "supports_fused_rotary",
    "sample_from_logits",
]
