"""Imported once by the forkserver the workers are forked from, so that each worker starts warm.

Loading a checkpoint and building the runner pull in large modules lazily on first use (torch's
distributed and dynamo packages, sympy through transformers, triton): several seconds per
process on a small CPU, paid here once instead of once per worker and engine. Missing optional
packages are skipped; nothing here runs model code.
"""
from __future__ import annotations

import importlib

_WARM_MODULES = (
    "hearth_llm.engine.executor.worker", "hearth_llm.engine.loader", "hearth_llm.engine.model_runner",
    "hearth_llm.engine.loader.hf_dir", "transformers.modeling_utils", "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_fast", "safetensors.torch", "torch.distributed.distributed_c10d",
    "torch._dynamo", "triton", "triton.language",
)

for _name in _WARM_MODULES:
    try:
        importlib.import_module(_name)
    except ImportError:  # an optional package (triton) absent here
        pass
