"""Which model class runs a checkpoint: filled by each model file's :func:`register_model`.

Every module of this package is imported once (:func:`import_model_files`), so a new
architecture is one new file here; nothing else lists it.

>>> @register_model("StarCoder2ForCausalLM", model_types=("starcoder2",),
...                 gguf={"starcoder2": GGUFArchitecture(config_class="Starcoder2Config")})
... class Starcoder2ForCausalLM(DecoderModel):
...     ...
"""
from __future__ import annotations

import importlib
import pkgutil
import warnings
from typing import Mapping

from transformers import PretrainedConfig

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

MODEL_CLASSES: dict[str, type] = {}
MODEL_TYPES: dict[str, str] = {}
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {}
# llama.cpp architecture name -> variants registered under it (``GGUFArchitecture.applies_to``).
GGUF_VARIANTS: dict[str, list[GGUFArchitecture]] = {}


def register_model(*architectures: str, model_types: tuple[str, ...] = (),
                   gguf: Mapping[str, GGUFArchitecture] | None = None):
    """Class decorator: ``architectures`` are the HF ``config.architectures`` names the class runs,
    ``model_types`` the ``config.model_type`` values (checkpoints without ``architectures``, as
    GGUF-built configs), ``gguf`` its llama.cpp architecture names (an entry with ``applies_to``
    is a variant of a name another model owns). The i-th model type maps to the i-th
    architecture name (or the first when there are fewer)."""
    def register(model_class):
        for name in architectures:
            MODEL_CLASSES[name] = model_class
        for index, model_type in enumerate(model_types):
            MODEL_TYPES[model_type] = architectures[min(index, len(architectures) - 1)]
        for gguf_name, spec in (gguf or {}).items():
            if spec.applies_to is None:
                GGUF_ARCHITECTURES[gguf_name] = spec
            else:
                GGUF_VARIANTS.setdefault(gguf_name, []).append(spec)
        return model_class

    return register


def model_class_for(config: PretrainedConfig):
    """The model class for a config; ``ValueError`` naming the architecture when unsupported."""
    declared = config.architectures or []
    if not isinstance(declared, (list, tuple)) or not all(isinstance(name, str) for name in declared):
        raise ValueError(f"config.json: architectures must be a list of class names, got {declared!r:.80}")
    architectures = list(declared) or [MODEL_TYPES.get(config.model_type, config.model_type)]
    for name in architectures:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    broken = f" (model files that failed to import: {sorted(BROKEN_MODEL_FILES)})" if BROKEN_MODEL_FILES else ""
    raise ValueError(f"model architecture {architectures} is not supported; supported: {sorted(MODEL_CLASSES)}{broken}")


def gguf_architecture(name, metadata=None) -> GGUFArchitecture | None:
    """The registered entry for a llama.cpp ``general.architecture`` value, or None; given the
    file's ``metadata``, the first variant registered under that name that applies to it."""
    if not isinstance(name, str) or name not in GGUF_ARCHITECTURES:
        return None
    if metadata is not None:
        for variant in GGUF_VARIANTS.get(name, ()):
            if variant.applies_to(metadata):
                return variant
    return GGUF_ARCHITECTURES[name]


# Model files that failed to import: module name -> the error, named when their architecture is asked for.
BROKEN_MODEL_FILES: dict[str, Exception] = {}


def import_model_files() -> None:
    """Import every module of this package, so each model file registers itself.

    A model file that fails to import is reported (a warning now, and in the error of
    :func:`model_class_for`) instead of breaking every other architecture.
    """
    package = importlib.import_module(__package__)
    for module in pkgutil.iter_modules(package.__path__):
        name = f"{__package__}.{module.name}"
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - one broken model file must not break the others
            BROKEN_MODEL_FILES[module.name] = error
            warnings.warn(f"model file {module.name}.py failed to import and is skipped: {error!r}", RuntimeWarning,
                          stacklevel=2)
