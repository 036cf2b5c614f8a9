"""Token sampling: ``reference.py`` (plain torch, also the CPU path), ``cpu.py`` (argmax and top-k
over vocabulary-wide rows), ``triton_sampling.py`` (a fused Gumbel-max draw on CUDA).

This package keeps the reference's names at ``hearth_llm.kernels.sampling``.
"""
from __future__ import annotations

from . import cpu, reference  # noqa: F401  (kernels dispatches to op.cpu and op.reference)
from .reference import GREEDY_TEMPERATURE, rows_needing_filtering, sample_from_logits

__all__ = ["GREEDY_TEMPERATURE", "rows_needing_filtering", "sample_from_logits"]
