"""Each op package's Triton module, imported on first use: ``<package>/triton_<op>.py``.

Importing it needs neither Triton nor a GPU; where Triton is missing the answer is None and the
caller falls back to its torch routine.

>>> triton_module("hearth_llm.kernels.no_such_op") is None
True
"""
from __future__ import annotations

import importlib

_UNSET = object()
_MODULES: dict[str, object] = {}


def triton_module(package: str):
    """The Triton module of op package ``package`` (e.g. ``hearth_llm.kernels.moe`` →
    ``hearth_llm.kernels.moe.triton_moe``), or None where it cannot be imported; looked up once."""
    module = _MODULES.get(package, _UNSET)
    if module is _UNSET:
        try:
            module = importlib.import_module(f"{package}.triton_{package.rsplit('.', 1)[1]}")
        except ImportError:
            module = None
        _MODULES[package] = module
    return module
