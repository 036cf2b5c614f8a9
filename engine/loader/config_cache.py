"""A model directory's config, remembered across processes so later starts skip transformers' model imports.

``AutoConfig.from_pretrained`` imports the model's ``configuration_*.py``, and with it (transformers 5)
``transformers.models``' index of every model file and a chain through ``activations`` and the
distributed helpers into ``torch.distributed.tensor`` and sympy: 4-9 s of a cold start on the H200
host, more than reading 16 GB of weights. The resolved config holds nothing those imports are needed
for afterwards, so the first load writes ``config.to_dict()`` (every field, defaults filled in) to
``~/.cache/hearth_llm/configs/``, keyed by the bytes of config.json and the transformers version, and
later loads rebuild the config from it on :class:`~transformers.PretrainedConfig` alone.

Only configs that rebuild exactly are remembered: a config class with properties, an
``attribute_map``, sub-configs or methods of its own beyond construction and validation is never
cached, and the rebuilt config must give back the same ``to_dict()`` and attributes before the entry
is written. The rebuilt class carries the original's name and ``model_type``.

>>> config = load_config(Path("models/llama/config.json"))    # AutoConfig, remembered
>>> config = load_config(Path("models/llama/config.json"))    # from the cache, no model imports
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CACHE_ROOT = Path("~/.cache/hearth_llm/configs")
_FORMAT = 1
# Not part of the model: where it was read from, the writer's version, a generation default v5 drops.
_IGNORED_KEYS = frozenset({"_name_or_path", "transformers_version", "use_cache"})
# What a plain config class may define besides field defaults (construction and checks only).
_CONSTRUCTION = frozenset({"__init__", "__post_init__", "__eq__", "__setattr__", "__repr__", "__hash__",
                           "__class_getitem__", "__init_subclass__"})
_rebuilt_classes: dict[tuple[str, str], type] = {}


def load_config(config_file: Path, cache_root: Path | None = None):
    """The config of ``config_file``'s directory: rebuilt from the cache when it holds it, else
    ``AutoConfig.from_pretrained`` (then remembered when it rebuilds exactly)."""
    entry = _entry(config_file, cache_root)
    cached = _read(entry, config_file.parent) if entry is not None else None
    if cached is not None:
        return cached
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(config_file.parent, trust_remote_code=False)
    if entry is not None:
        remember(entry, config)
    return config


def remember(entry: Path, config) -> bool:
    """Write ``config`` to ``entry`` if it rebuilds exactly; whether it was written."""
    if not is_plain_config_class(type(config)):
        return False
    data = config.to_dict()
    rebuilt = _rebuild(type(config).__name__, type(config).model_type, data)
    if not _same(config, rebuilt):
        return False
    record = {"format": _FORMAT, "class_name": type(config).__name__, "model_type": type(config).model_type,
              "config": data}
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(record))
        os.replace(partial, entry)  # readers see all of it or nothing
    except OSError:
        return False  # a read-only home: every start resolves the config itself
    return True


def is_plain_config_class(config_class: type) -> bool:
    """Whether everything ``config_class`` adds to ``PretrainedConfig`` is field defaults and
    construction (so its ``to_dict()`` is all there is to it)."""
    from transformers import PretrainedConfig

    for klass in config_class.__mro__:
        if klass is PretrainedConfig:
            return True
        if getattr(klass, "attribute_map", None) or getattr(klass, "sub_configs", None):
            return False
        for name, value in vars(klass).items():
            if isinstance(value, (property, staticmethod, classmethod)) or hasattr(value, "__set_name__"):
                if not name.startswith("__"):
                    return False
            elif callable(value) and name not in _CONSTRUCTION and not name.startswith("validate"):
                return False
    return False  # not a PretrainedConfig at all


def _rebuild(class_name: str, model_type: str, data: dict):
    from transformers import PretrainedConfig

    key = (class_name, model_type)
    if key not in _rebuilt_classes:
        _rebuilt_classes[key] = type(class_name, (PretrainedConfig,), {
            "model_type": model_type, "__module__": __name__,
            "__doc__": f"{class_name} rebuilt from hearth-llm's config cache (fields only)."})
    return _rebuilt_classes[key].from_dict(dict(data))


def _same(config, rebuilt) -> bool:
    original, again = _comparable(config.to_dict()), _comparable(rebuilt.to_dict())
    if original != again:
        return False
    return all(getattr(rebuilt, name, _MISSING) == getattr(config, name, _MISSING) for name in original)


def _comparable(data: dict) -> dict:
    return {name: value for name, value in data.items() if name not in _IGNORED_KEYS}


_MISSING = object()


def _read(entry: Path, directory: Path):
    try:
        record = json.loads(entry.read_text())
        if record.get("format") != _FORMAT:
            return None
        config = _rebuild(record["class_name"], record["model_type"], record["config"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing, half-written by an old version, or unreadable: resolve it again
    config._name_or_path = str(directory)
    return config


def _entry(config_file: Path, cache_root: Path | None) -> Path | None:
    try:
        import transformers

        digest = hashlib.sha256(config_file.read_bytes()).hexdigest()[:32]
    except OSError:
        return None
    root = (cache_root or CACHE_ROOT).expanduser()
    return root / f"{digest}-transformers-{transformers.__version__}.json"
