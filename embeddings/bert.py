"""A BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa) in plain torch, for embedding only.

What differs from the transformers implementation, and why:

- Padding costs nothing in the dense layers, which are ~90 % of the time: they run on the packed
  real tokens ``[num_tokens, hidden]``; only attention sees the padded ``[batch, length]`` layout
  (scattered in and gathered out per layer), and gets no mask at all when nothing is padded.
- Query, key and value are one fused projection; every dense layer goes through
  :class:`~.linear.Linear` (oneDNN with the bias and GELU fused on CPU).
- No pooler, no dropout, no attention-probability outputs.

RoBERTa differs from BERT only in where its positions start (``pad_token_id + 1``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .linear import Linear

SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
_ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "relu": "relu"}
_KEY_PREFIXES = ("bert.", "roberta.", "model.")


@dataclass(slots=True)
class BertConfig:
    """The fields of a BERT-family config.json that the encoder needs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    activation: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int   # 0 for BERT; pad_token_id + 1 for RoBERTa-style models

    @classmethod
    def from_dict(cls, config: dict) -> BertConfig:
        """Raises ``ValueError`` for configs this encoder cannot run exactly."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a supported BERT-family type {SUPPORTED_MODEL_TYPES}")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config['position_embedding_type']!r} is not supported")
        activation = config.get("hidden_act", "gelu")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {activation!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        is_roberta = model_type != "bert"
        return cls(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                   num_hidden_layers=config["num_hidden_layers"], num_attention_heads=config["num_attention_heads"],
                   intermediate_size=config["intermediate_size"], activation=_ACTIVATIONS[activation],
                   max_position_embeddings=config["max_position_embeddings"],
                   type_vocab_size=config.get("type_vocab_size", 2), layer_norm_eps=config.get("layer_norm_eps", 1e-12),
                   position_offset=config.get("pad_token_id", 1) + 1 if is_roberta else 0)


@dataclass(slots=True)
class PackedLayout:
    """Where the real tokens of a right-padded ``[batch, length]`` batch sit once packed."""

    batch: int
    length: int
    token_index: torch.Tensor | None     # [num_tokens] flat padded position of each token; None: no padding
    attention_mask: torch.Tensor | None  # [batch, 1, 1, length] keys to attend to; None: all

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor) -> PackedLayout:
        batch, length = attention_mask.shape
        if bool(attention_mask.all()):
            return cls(batch, length, None, None)
        token_index = attention_mask.flatten().nonzero().squeeze(1)
        return cls(batch, length, token_index, attention_mask.bool()[:, None, None, :])

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """``[batch * length, ...]`` → ``[num_tokens, ...]``."""
        return padded if self.token_index is None else padded.index_select(0, self.token_index)

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, width]`` → ``[batch * length, width]``, zeros where padding is."""
        if self.token_index is None:
            return packed
        padded = packed.new_zeros(self.batch * self.length, packed.shape[1])
        return padded.index_copy_(0, self.token_index, packed)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = Linear(hidden, 3 * hidden)
        self.out_proj = Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.up_proj = Linear(hidden, config.intermediate_size, activation=config.activation)
        self.down_proj = Linear(config.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        """``hidden`` is ``[num_tokens, hidden]``, packed as ``layout`` says."""
        width = hidden.shape[1]
        qkv = layout.pad(self.qkv_proj(hidden)).view(layout.batch, layout.length, 3, self.num_heads, self.head_dim)
        query, key, value = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask=layout.attention_mask)
        attended = layout.pack(attended.transpose(1, 2).reshape(layout.batch * layout.length, width))
        hidden = self.attention_norm(hidden + self.out_proj(attended))
        return self.output_norm(hidden + self.down_proj(self.up_proj(hidden)))


class BertEncoder(nn.Module):
    """Token ids → last hidden states.

    >>> encoder = BertEncoder.from_pretrained(path, dtype=torch.float32, device=torch.device("cpu"))
    >>> encoder(input_ids, attention_mask).shape           # [batch, length, hidden]
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embedding_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``input_ids`` and ``attention_mask`` are ``[batch, length]``, right-padded; returns
        ``[batch, length, hidden]`` with zeros at the padded positions."""
        batch, length = input_ids.shape
        layout = PackedLayout.from_mask(attention_mask)
        offset = self.config.position_offset
        # Right padding puts every real token at the position it would have alone.
        positions = torch.arange(offset, offset + length, device=input_ids.device).expand(batch, length)
        input_ids, positions = layout.pack(input_ids.reshape(-1)), layout.pack(positions.reshape(-1))
        hidden = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                  + self.token_type_embeddings.weight[0])
        hidden = self.embedding_norm(hidden)
        for layer in self.layers:
            hidden = layer(hidden, layout)
        return layout.pad(hidden).view(batch, length, -1)

    def prepack(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype, device: torch.device) -> BertEncoder:
        """Build from ``path/config.json`` and its safetensors weights (one file or sharded)."""
        with open(Path(path) / "config.json", encoding="utf-8") as file:
            config = BertConfig.from_dict(json.load(file))
        encoder = cls(config)
        encoder.load_state_dict(_our_state_dict(_read_safetensors(Path(path)), config.num_hidden_layers))
        encoder.to(device=device, dtype=dtype).eval()
        encoder.requires_grad_(False)
        encoder.prepack()
        return encoder


def has_safetensors(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as file:
            files = sorted(set(json.load(file)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as file:
            for key in file.keys():
                tensors[_canonical_key(key)] = file.get_tensor(key)
    return tensors


def _canonical_key(key: str) -> str:
    for prefix in _KEY_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    # Checkpoints from the TF era name LayerNorm parameters gamma and beta.
    return key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def _our_state_dict(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    def take(key: str) -> torch.Tensor:
        if key not in weights:
            raise ValueError(f"the checkpoint has no tensor {key!r}; is this a BERT-family encoder?")
        return weights[key]

    state = {}
    for ours, theirs in (("word_embeddings", "embeddings.word_embeddings"),
                         ("position_embeddings", "embeddings.position_embeddings"),
                         ("token_type_embeddings", "embeddings.token_type_embeddings")):
        state[f"{ours}.weight"] = take(f"{theirs}.weight")
    for param in ("weight", "bias"):
        state[f"embedding_norm.{param}"] = take(f"embeddings.LayerNorm.{param}")
        for i in range(num_layers):
            theirs, ours = f"encoder.layer.{i}.", f"layers.{i}."
            state[ours + f"qkv_proj.{param}"] = torch.cat(
                [take(theirs + f"attention.self.{name}.{param}") for name in ("query", "key", "value")])
            state[ours + f"out_proj.{param}"] = take(theirs + f"attention.output.dense.{param}")
            state[ours + f"attention_norm.{param}"] = take(theirs + f"attention.output.LayerNorm.{param}")
            state[ours + f"up_proj.{param}"] = take(theirs + f"intermediate.dense.{param}")
            state[ours + f"down_proj.{param}"] = take(theirs + f"output.dense.{param}")
            state[ours + f"output_norm.{param}"] = take(theirs + f"output.LayerNorm.{param}")
    return state
