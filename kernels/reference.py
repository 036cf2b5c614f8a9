"""Every op's plain-torch reference under one name (each lives in its op's ``reference.py``).

They define the semantics the CPU routines and Triton kernels are tested against.

>>> from hearth_llm.kernels import reference
>>> reference.silu_and_mul(torch.ones(2, 8)).shape
torch.Size([2, 4])
"""
from __future__ import annotations

import torch  # noqa: F401  (the doctest)

from .activation.reference import (GELU_APPROXIMATIONS, check_gelu_approximate, gelu, gelu_and_mul,
                                   silu_and_mul)
from .attention.reference import check_soft_cap, paged_attention, scaled_dot_product_attention
from .kv_cache.reference import write_kv_cache
from .norm.reference import layer_norm, rms_norm
from .rotary.reference import check_rotary_dim, rotary_embedding
from .sampling.reference import argmax

__all__ = ["GELU_APPROXIMATIONS", "argmax", "check_gelu_approximate", "check_rotary_dim", "check_soft_cap", "gelu",
           "gelu_and_mul", "layer_norm", "paged_attention", "rms_norm", "rotary_embedding",
           "scaled_dot_product_attention", "silu_and_mul", "write_kv_cache"]
