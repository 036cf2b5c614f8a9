"""Our model implementations, chosen by the checkpoint's ``architectures`` entry.

Each model file registers its class with :func:`registry.register_model`; every module of this
package is imported here so that registration happens. See :mod:`.decoder` for how to add one.
"""
from __future__ import annotations

from .registry import GGUF_ARCHITECTURES, MODEL_CLASSES, MODEL_TYPES, gguf_architecture, import_model_files, \
    model_class_for

import_model_files()

from .llama import LlamaForCausalLM  # noqa: E402
from .qwen2 import Qwen2ForCausalLM  # noqa: E402
from .qwen3 import Qwen3ForCausalLM  # noqa: E402

__all__ = ["GGUF_ARCHITECTURES", "MODEL_CLASSES", "MODEL_TYPES", "gguf_architecture", "model_class_for",
           "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
