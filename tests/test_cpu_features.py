"""The CPU compute path: dtype="auto" takes bf16 only where the CPU's flags say bf16 is native,
and the choice can be checked for any CPU by handing it flags."""
from __future__ import annotations

import torch

from hearth_llm.engine import cpu_features
from hearth_llm.engine.config import EngineConfig

AVX2_ONLY = {"fpu", "sse4_2", "avx", "avx2", "fma", "f16c"}            # e.g. an AMD EPYC Zen 2/3
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512_vnni", "avx512_bf16"}   # Zen 4, Cooper Lake
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}              # Sapphire Rapids and later


def test_an_avx2_only_cpu_takes_float32_and_says_why():
    path = cpu_features.cpu_dtype_path(AVX2_ONLY)
    assert path.dtype_name == "float32" and not path.has_native_bf16
    assert "avx512_bf16" in path.reason and "amx_bf16" in path.reason
    assert path.flags_found == ("avx2", "fma")


def test_avx512_bf16_or_amx_takes_bfloat16_naming_the_flag():
    assert cpu_features.cpu_dtype_path(AVX512_BF16).dtype_name == "bfloat16"
    assert cpu_features.cpu_dtype_path(AVX512_BF16).reason.startswith("avx512_bf16")
    assert cpu_features.cpu_dtype_path(AMX).reason.startswith("amx_bf16")
    assert cpu_features.cpu_dtype_path({"amx_bf16"}).has_native_bf16


def test_no_readable_flags_take_float32():
    path = cpu_features.cpu_dtype_path(set())
    assert path.dtype_name == "float32" and "no CPU flags" in path.reason


def test_engine_config_auto_dtype_follows_the_injected_flags(monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(AVX2_ONLY))
    assert EngineConfig(model="default", device="cpu").torch_dtype == torch.float32
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(AMX))
    assert EngineConfig(model="default", device="cpu").torch_dtype == torch.bfloat16
    assert EngineConfig(model="default", device="cpu", dtype="float32").torch_dtype == torch.float32


def test_the_benchmark_line_names_the_path_and_the_flags_found(monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(AVX2_ONLY))
    line = cpu_features.describe_cpu_path()
    assert "CPU path float32" in line and "flags found: avx2 fma" in line
    assert "none of" in cpu_features.describe_cpu_path(set())


def test_this_machines_flags_agree_with_proc_cpuinfo():
    with open("/proc/cpuinfo", encoding="utf-8") as file:
        flags = next(line for line in file if line.startswith("flags")).split(":", 1)[1].split()
    assert cpu_features.cpu_flags() == frozenset(flags)
    assert cpu_features.cpu_dtype_path().has_native_bf16 == ("avx512_bf16" in flags or "amx_bf16" in flags)
