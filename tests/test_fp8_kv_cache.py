"""Writing keys and values into an fp8 (e4m3) paged cache: the Triton write and the fused
attention-inputs kernel against the torch reference (quantize by the per-layer scale, saturate,
round to nearest); on CPU under the Triton interpreter."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
pytest.importorskip("triton")

from hearth_llm.kernels.attention_inputs import reference as inputs_reference  # noqa: E402
from hearth_llm.kernels.attention_inputs import triton_attention_inputs  # noqa: E402
from hearth_llm.kernels.kv_cache import reference as cache_reference  # noqa: E402
from hearth_llm.kernels.kv_cache import triton_kv_cache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def assert_within_one_fp8_step(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for rare ties and inputs one fp32 step off (the kernels divide by the scale in
    fast fp32; under the interpreter ties round away from zero); never more than one e4m3 step,
    which is 1/8 of the value's power of two (2^-9 below 2^-6)."""
    actual, expected = actual.float(), expected.float()
    step = torch.where(expected.abs() < 2 ** -6, torch.full_like(expected, 2 ** -9),
                       2.0 ** torch.floor(torch.log2(expected.abs().clamp_min(2 ** -6))) / 8)
    assert ((actual - expected).abs() <= step * 1.001).all()
    assert (actual == expected).float().mean() > 0.995


def test_reference_write_quantizes_by_the_scale_and_saturates():
    cache = torch.zeros(2, 4, 1, 4, dtype=FP8)
    key = torch.tensor([[[1.0, -3.0, 1000.0, 0.3]]])
    cache_reference.write_kv_cache(key, key, cache, cache.clone(), torch.tensor([5]), torch.tensor([2.0, 1.0]))
    assert cache.view(-1, 1, 4)[5].float().tolist() == [[0.5, -1.5, 448.0, 0.15625]]


@pytest.mark.parametrize("scales", [None, (0.05, 0.5)])
def test_triton_write_into_fp8_cache_matches_reference(scales):
    generator = torch.Generator().manual_seed(0)
    key = (8 * torch.randn(6, 2, 32, generator=generator)).to(DEVICE)
    value = torch.randn(6, 2, 32, generator=generator).to(DEVICE)
    slots = torch.tensor([3, 0, 17, 9, -1, 30], device=DEVICE)
    kv_scales = None if scales is None else torch.tensor(scales, device=DEVICE)
    caches = [torch.zeros(2, 16, 2, 32, dtype=FP8, device=DEVICE) for _ in range(4)]
    triton_kv_cache.write_kv_cache(key, value, caches[0], caches[1], slots, kv_scales)
    real = slots >= 0
    cache_reference.write_kv_cache(key[real], value[real], caches[2], caches[3], slots[real], kv_scales)
    assert_within_one_fp8_step(caches[0], caches[2])
    assert_within_one_fp8_step(caches[1], caches[3])


@pytest.mark.parametrize("has_norm", [False, True])
def test_fused_attention_inputs_quantize_keys_and_values_into_fp8_cache(has_norm):
    generator = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    qkv = (4 * torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)).to(DEVICE)
    positions = torch.tensor([0, 7, 3, 100, 41], device=DEVICE)
    cos_sin = torch.randn(128, head_dim, generator=generator).to(DEVICE)
    norms = [torch.rand(head_dim, generator=generator).to(DEVICE) + 0.5 for _ in range(2)] if has_norm else [None, None]
    slots = torch.tensor([4, 1, 30, 12, 19], device=DEVICE)
    kv_scales = torch.tensor([0.1, 0.02], device=DEVICE)
    caches = [torch.zeros(2, 16, num_kv_heads, head_dim, dtype=FP8, device=DEVICE) for _ in range(4)]
    query = triton_attention_inputs.qk_norm_rope_and_cache(qkv, positions, cos_sin, caches[0], caches[1], slots,
                                                           num_heads, num_kv_heads, *norms, kv_scales=kv_scales)
    want = inputs_reference.qk_norm_rope_and_cache(qkv, positions, cos_sin, caches[2], caches[3], slots, num_heads,
                                                   num_kv_heads, *norms, 1e-6, True, kv_scales)
    torch.testing.assert_close(query, want, atol=1e-4, rtol=1e-4)
    assert_within_one_fp8_step(caches[0], caches[2])
    assert_within_one_fp8_step(caches[1], caches[3])
    assert caches[1].float().abs().max() > 10  # values / 0.02: the scale was applied
