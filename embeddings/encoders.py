"""Which of our encoders runs a model_type, and whether it can run a given config exactly."""
from __future__ import annotations

from .bert import SUPPORTED_MODEL_TYPES as BERT_MODEL_TYPES
from .bert import BertConfig, BertEncoder
from .modernbert import ModernBertConfig, ModernBertEncoder
from .nomic_bert import NomicBertConfig, NomicBertEncoder

# model_type (config.json) → (encoder class, its config class)
ENCODERS = {**{model_type: (BertEncoder, BertConfig) for model_type in BERT_MODEL_TYPES},
            "nomic_bert": (NomicBertEncoder, NomicBertConfig),
            "modernbert": (ModernBertEncoder, ModernBertConfig)}
SUPPORTED_MODEL_TYPES = tuple(ENCODERS)


def encoder_class(model_type: str):
    """The encoder class for ``model_type``; ``ValueError`` naming it when we have none.

    >>> encoder_class("xlm-roberta").__name__
    'BertEncoder'
    """
    if model_type not in ENCODERS:
        raise ValueError(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    return ENCODERS[model_type][0]


def check_config(config: dict) -> None:
    """Raises ``ValueError`` naming the first field our encoder for this model_type cannot run exactly."""
    model_type = config.get("model_type", "")
    encoder_class(model_type)
    ENCODERS[model_type][1].from_dict(config)
