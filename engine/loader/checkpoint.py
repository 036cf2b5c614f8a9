"""What every loader returns: a config, weights in Hugging Face names, and a tokenizer."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase


@dataclass(slots=True)
class LoadedCheckpoint:
    """A model checkpoint ready for our model classes.

    `state_dict` uses Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``),
    already in the compute dtype, so one model implementation serves every file format.
    """

    config: PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase
    source: str
