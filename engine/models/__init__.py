"""Our model implementations, chosen by the checkpoint's ``architectures`` entry."""
from __future__ import annotations

from transformers import PretrainedConfig

from .llama import LlamaForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

# Mistral is Llama plus a sliding window, which ArchConfig reads from the config.
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}


def model_class_for(config: PretrainedConfig):
    """The model class for a config; ``ValueError`` naming the architecture when unsupported."""
    declared = config.architectures or []
    if not isinstance(declared, (list, tuple)) or not all(isinstance(name, str) for name in declared):
        raise ValueError(f"config.json: architectures must be a list of class names, got {declared!r:.80}")
    architectures = list(declared) or [MODEL_TYPES.get(config.model_type, config.model_type)]
    for name in architectures:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise ValueError(f"model architecture {architectures} is not supported; supported: {sorted(MODEL_CLASSES)}")
