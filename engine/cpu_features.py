"""Which CPU compute path the engine takes (bf16 or fp32) and why: read from the CPU's flags.

bf16 pays on a CPU only where it is native: ``avx512_bf16`` (AVX-512 BF16 dot products) or
``amx_bf16`` (AMX tiles). Elsewhere (an AVX2-only Zen 2/3 or an older Xeon) torch emulates bf16 by
converting to fp32 around every op, slower than fp32 itself, so ``dtype="auto"`` picks fp32 there.
The flags come from ``/proc/cpuinfo`` unless given, so the choice is testable for any CPU:

>>> cpu_dtype_path({"avx", "avx2", "fma"}).dtype_name
'float32'
>>> cpu_dtype_path({"avx2", "avx512f", "avx512_bf16"}).dtype_name
'bfloat16'
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Flags that make bf16 matmuls native; the first found is named as the reason.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# Flags reported beside the choice, to say which kind of CPU a number came from.
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True, slots=True)
class CpuDtypePath:
    """The compute dtype ``dtype="auto"`` takes on this CPU (for a 16-bit or GGUF checkpoint), and why."""

    dtype_name: str                # "bfloat16" or "float32"
    reason: str
    flags_found: tuple[str, ...]   # of REPORTED_FLAGS, in that order

    @property
    def has_native_bf16(self) -> bool:
        return self.dtype_name == "bfloat16"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (the first ``flags`` line of /proc/cpuinfo); empty where unreadable."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cpu_dtype_path(flags: Iterable[str] | None = None) -> CpuDtypePath:
    """The path for ``flags`` (this CPU's when None)."""
    flags = cpu_flags() if flags is None else frozenset(flags)
    found = tuple(flag for flag in REPORTED_FLAGS if flag in flags)
    native = next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)
    if native is not None:
        return CpuDtypePath("bfloat16", f"{native} found: bf16 matmuls are native", found)
    if not flags:
        return CpuDtypePath("float32", "no CPU flags readable (no /proc/cpuinfo): bf16 assumed emulated", found)
    return CpuDtypePath("float32", "neither avx512_bf16 nor amx_bf16 found: bf16 would be emulated, slower "
                        "than fp32", found)


@functools.cache
def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (``"unknown CPU"`` where unreadable)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "unknown CPU"
    line = next((line for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    return line.split(":", 1)[1].strip() if ":" in line else "unknown CPU"


def describe_cpu_path(flags: Iterable[str] | None = None) -> str:
    """One line for a benchmark's header: the CPU, the path, the reason and the flags found.

    >>> describe_cpu_path({"avx2", "fma"})
    '... CPU path float32 (neither avx512_bf16 nor amx_bf16 found: ...); flags found: avx2 fma'
    """
    path = cpu_dtype_path(flags)
    found = " ".join(path.flags_found) if path.flags_found else f"none of {' '.join(REPORTED_FLAGS)}"
    return f"{cpu_model_name()}: CPU path {path.dtype_name} ({path.reason}); flags found: {found}"
