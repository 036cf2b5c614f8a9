"""Build a C kernel file with the system's compiler at first use, cached per machine.

The shared library lands under ``~/.cache/hearth_llm/kernels`` (``HEARTH_LLM_KERNEL_CACHE``), keyed
by the source, the flags, the compiler and its version and this CPU's flags, so each machine compiles
once. ``HEARTH_LLM_KERNEL_CFLAGS`` adds flags after the caller's (``-mno-avx512f`` builds the AVX2 paths).

>>> path = build_library(Path("k.c"), "k", ("-O2", "-fPIC", "-shared"), "my kernels")  # None if it cannot
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

EXTRA_FLAGS_ENV = "HEARTH_LLM_KERNEL_CFLAGS"


def build_library(source_path: Path, prefix: str, flags: tuple[str, ...], what: str,
                  libraries: tuple[str, ...] = ()) -> Path | None:
    """The shared library of ``source_path`` (built now unless cached), or None where no compiler is
    found or the build fails (with a warning that says ``what`` falls back to torch)."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    flags = (*flags, *os.environ.get(EXTRA_FLAGS_ENV, "").split())
    key = hashlib.sha256(b"\0".join([source_path.read_bytes(), " ".join((*flags, *libraries)).encode(),
                                     compiler.encode(), _compiler_version(compiler), _cpu_flags()])).hexdigest()[:16]
    cache = Path(os.environ.get("HEARTH_LLM_KERNEL_CACHE", "~/.cache/hearth_llm/kernels")).expanduser()
    path = cache / f"{prefix}_{key}.so"
    if path.exists():
        return path
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            built = Path(scratch) / path.name
            subprocess.run([compiler, *flags, str(source_path), "-o", str(built), *libraries], check=True,
                           capture_output=True, timeout=300)
            os.replace(built, path)  # atomic: a concurrent process sees the whole library or none
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        warnings.warn(f"{what} not built ({error}; {detail.decode(errors='replace')[:500]}); they fall back to "
                      "their torch routines", RuntimeWarning, stacklevel=3)
        return None
    return path


def _compiler_version(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


def _cpu_flags() -> bytes:
    """This CPU's feature flags (``-march=native`` builds for them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return b""
