"""One engine per model and config in a process: ``get_engine`` hands out a shared ``EngineCore``,
so ``LLM``, ``AsyncLLM`` and the LangChain and LlamaIndex classes on the same model share one KV
cache and its prefix reuse.
"""
from __future__ import annotations

import atexit
import os
import threading
from dataclasses import fields

from .chat.prompt import ChatPrompt, render_chat_prompt
from .config import EngineConfig
from .engine_core import EngineCore
from .loader import DEFAULT_MODEL, default_model_path
from .outputs import StreamOutput, Usage
from .replicas.options import ReplicaOptions, split_replica_options
from .streams import RequestStream

__all__ = ["get_engine", "shutdown_engines", "EngineCore", "RequestStream", "StreamOutput", "Usage", "ChatPrompt",
           "render_chat_prompt"]

# Options that do not change what the engine computes; handles that differ only in them share one.
# (keep_alive and sleep_level: the last handle that passes them sets them on the shared engine.)
_OPTIONS_NOT_IN_KEY = frozenset({"show_progress", "keep_alive", "sleep_level"})

# ---- the registry --------------------------------------------------------------------------

_registry_lock = threading.Lock()
_cores: dict[tuple, EngineCore] = {}


def get_engine(model: str = "default", **engine_kwargs) -> EngineCore:
    """The process's shared engine for this model and config; created (not loaded) on first ask.

    >>> from hearth_llm.engine import get_engine
    >>> get_engine("default") is get_engine("default", dtype="auto")
    True

    Keyword arguments are :class:`EngineConfig` fields, plus ``replicas``/``backend``/``ray_address``
    (:class:`~.replicas.ReplicaOptions`: N engine replicas as Ray actors); the first handle's ``show_progress`` wins,
    the last ``keep_alive`` / ``sleep_level`` given wins. A stopped engine (closed or dead) is
    replaced by a fresh one.
    """
    replica_options, engine_kwargs = split_replica_options(engine_kwargs)
    config = EngineConfig.from_kwargs(model, **engine_kwargs)
    key = _config_key(config) + ((("replica_options", replica_options),) if replica_options.is_distributed else ())
    with _registry_lock:
        core = _cores.get(key)
        if core is None or core.is_stopped:
            core = _new_core(config, replica_options, engine_kwargs)
            _cores[key] = core
        elif "keep_alive" in engine_kwargs or "sleep_level" in engine_kwargs:
            core.set_keep_alive(config.keep_alive if "keep_alive" in engine_kwargs else core.keep_alive,
                                config.sleep_level if "sleep_level" in engine_kwargs else None)
        return core


def _new_core(config: EngineConfig, replica_options: ReplicaOptions, engine_kwargs: dict):
    """One engine here, or for ``backend="ray"`` a :class:`~.replicas.ReplicaSet` of Ray actors."""
    if replica_options.is_distributed:
        from .replicas.replica_set import ReplicaSet  # imported (with Ray) only when asked for

        return ReplicaSet(config, replica_options, engine_kwargs, on_stop=_forget_core)
    return _core_class(config)(config, on_stop=_forget_core)


def _core_class(config: EngineConfig):
    """The in-thread core, or for ``engine_core="process"`` the one whose engine runs in a child process."""
    if config.engine_core == "process":
        from .core_process import ProcessEngineCore  # imported only when asked for

        return ProcessEngineCore
    return EngineCore


def shutdown_engines() -> None:
    """Close every shared engine (runs at interpreter exit)."""
    with _registry_lock:
        cores = list(_cores.values())
    for core in cores:
        core.close()


def _forget_core(core: EngineCore) -> None:
    with _registry_lock:
        for key, value in list(_cores.items()):
            if value is core:
                del _cores[key]


def _config_key(config: EngineConfig) -> tuple:
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in _OPTIONS_NOT_IN_KEY}
    values["model"] = _normalize_model(config.model)
    values["device"] = str(config.torch_device)
    values["dtype"] = str(config.torch_dtype)
    return tuple(sorted(values.items()))


def _normalize_model(model: str) -> str:
    """One name per checkpoint, so ``"default"`` and the bundled file's path share an engine."""
    if model == DEFAULT_MODEL:
        try:
            model = str(default_model_path())
        except ValueError:
            return model  # not installed: loading will say so
    path = os.path.expanduser(model)
    return os.path.realpath(path) if os.path.exists(path) else model


atexit.register(shutdown_engines)
