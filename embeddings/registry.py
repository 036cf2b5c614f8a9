"""One embedding engine per model and config in a process, shared by every caller: the LangChain
and LlamaIndex classes on the same model batch together and hold the weights once."""
from __future__ import annotations

import os
import threading
from dataclasses import fields

from .config import EmbeddingConfig
from .engine import EmbeddingEngine
from .model_dir import resolve_model_path

# Options that do not change what the engine computes; engines that differ only in them are shared.
_OPTIONS_NOT_IN_KEY = frozenset({"show_progress"})

_registry_lock = threading.Lock()
_engines: dict[tuple, EmbeddingEngine] = {}


def get_embedding_engine(model: str = "default", **options) -> EmbeddingEngine:
    """The process's shared :class:`EmbeddingEngine` for ``model``; created (not loaded) on first ask.

    >>> from hearth_llm.embeddings import get_embedding_engine
    >>> engine = get_embedding_engine()              # all-MiniLM-L6-v2
    >>> engine is get_embedding_engine("default", max_batch_tokens=2048)
    True
    >>> engine.embed(["hello world"]).shape
    torch.Size([1, 384])

    Keyword arguments are :class:`EmbeddingConfig` fields. A closed or dead engine is replaced by a
    fresh one.
    """
    config = EmbeddingConfig.from_kwargs(model, **options)
    key = _config_key(config)
    with _registry_lock:
        engine = _engines.get(key)
        if engine is None or engine.is_stopped:
            engine = EmbeddingEngine(config)
            _engines[key] = engine
        return engine


def shutdown_embedding_engines() -> None:
    """Close every shared embedding engine and forget it (interpreter exit does this too)."""
    with _registry_lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.close()


def _config_key(config: EmbeddingConfig) -> tuple:
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in _OPTIONS_NOT_IN_KEY}
    try:
        values["model"] = str(resolve_model_path(config.model))   # "default" and its path share one
    except ValueError:
        values["model"] = os.path.expanduser(config.model)        # the engine will say what is wrong
    values["device"] = str(config.torch_device)
    values["max_batch_tokens"] = config.batch_token_budget
    values["max_batch_size"] = config.batch_size_limit
    values["num_workers"] = config.worker_count
    return tuple(sorted(values.items()))
