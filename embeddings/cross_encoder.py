"""A cross-encoder reranker: a BERT-family encoder reads query and document together, and a
sequence-classification head turns the first token's vector into one relevance logit.

``BertForSequenceClassification`` (ms-marco MiniLM cross-encoders) and
``XLMRobertaForSequenceClassification`` / ``RobertaForSequenceClassification`` (bge-reranker-v2-m3)
compute the same thing under different names: ``out(tanh(dense(h[CLS])))`` — BERT's pooler is
the dense layer, RoBERTa's classification head has its own. BERT pairs carry token types (0 for
the query and its ``[SEP]``, 1 for the document); RoBERTa-style models have one type.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .bert import BertConfig, BertEncoder, read_safetensors
from .linear import Linear

SCORE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "identity": lambda x: x, "tanh": torch.tanh}
# (dense, output) weight names of each head, after the model-class prefix is cut.
_HEAD_NAMES = (("pooler.dense", "classifier"), ("classifier.dense", "classifier.out_proj"))


class CrossEncoder(nn.Module):
    """Token ids of ``[CLS] query [SEP] document [SEP]`` pairs → one logit per pair.

    >>> model = CrossEncoder.from_pretrained(path, dtype=torch.float32, device=torch.device("cpu"))
    >>> model(input_ids, attention_mask, token_type_ids).shape          # [batch]
    """

    def __init__(self, encoder: BertEncoder) -> None:
        super().__init__()
        hidden = encoder.config.hidden_size
        self.encoder = encoder
        self.dense = Linear(hidden, hidden)
        self.out_proj = Linear(hidden, 1)

    @property
    def is_mixed_precision(self) -> bool:
        return False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        first = self.encoder(input_ids, attention_mask, token_type_ids)[:, 0]
        return self.out_proj(torch.tanh(self.dense(first))).squeeze(-1)

    def prepack(self, mixed_precision: bool = False) -> None:
        self.encoder.prepack()
        self.dense.prepack()
        self.out_proj.prepack()

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype, device: torch.device) -> CrossEncoder:
        with open(Path(path) / "config.json", encoding="utf-8") as file:
            config = BertConfig.from_dict(json.load(file))
        weights = read_safetensors(Path(path))
        model = cls(BertEncoder.from_weights(config, weights, dtype, device))
        dense, out = next(((d, o) for d, o in _HEAD_NAMES if f"{d}.weight" in weights and f"{o}.weight" in weights),
                          (None, None))
        if dense is None:
            raise ValueError(f"{path}: no sequence-classification head (pooler.dense + classifier, or "
                             "classifier.dense + classifier.out_proj) in the checkpoint")
        model.dense.load_state_dict({"weight": weights[f"{dense}.weight"], "bias": weights[f"{dense}.bias"]})
        model.out_proj.load_state_dict({"weight": weights[f"{out}.weight"], "bias": weights[f"{out}.bias"]})
        model.to(device=device, dtype=dtype).eval()
        model.requires_grad_(False)
        model.prepack()
        return model


def pair_token_types(input_ids: torch.Tensor, attention_mask: torch.Tensor, sep_token_id: int) -> torch.Tensor:
    """BERT's token types of right-padded ``[CLS] a [SEP] b [SEP]`` rows: 1 after the first ``[SEP]``."""
    is_sep = (input_ids == sep_token_id).long()
    after_first_sep = (is_sep.cumsum(dim=1) - is_sep) > 0
    return (after_first_sep & attention_mask.bool()).long()
