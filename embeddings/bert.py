"""A BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa) in plain torch, for embedding only.

What differs from the transformers implementation, and why:

- Padding costs nothing: the dense layers (~90 % of the time) run on the packed real tokens
  ``[num_tokens, hidden]``, and attention runs once per run of equal-length texts, straight on
  views of the packed query/key/value, with no mask. Batches come sorted by length, so a batch has
  a few runs; against one padded, masked attention per batch this embedded 1.16× the sentences
  per CPU-second on all-MiniLM-L6-v2 (the pad/scatter copies and the mask cost more than the
  extra attention calls). On CUDA in half precision one variable-length flash attention per layer
  takes all texts at once (:mod:`~.varlen_attention`), and the layout comes from the token counts
  the host already knows, so nothing in a forward pass waits for the device.
- Query, key and value are one fused projection; every dense layer goes through
  :class:`~.linear.Linear` (oneDNN with the bias and GELU fused on CPU).
- No pooler, no dropout, no attention-probability outputs.
- Mixed precision (``prepack(mixed_precision=True)``): a float32 model whose attention output
  projections and last feed-forward block multiply in bf16. Those are the layers whose rounding
  moves the final embedding least — the attention output is added to a residual stream that stays
  float32, and nothing after the last block amplifies its error. On all-MiniLM-L6-v2 that is 16 %
  of the dense FLOPs at twice the speed, and the worst cosine to sentence-transformers over 1000
  sentences goes from 0.9999999 to 0.9999944; bf16 in any query/key/value or earlier feed-forward
  projection costs more (0.99998). Very short texts average the rounding over too few tokens
  (one word, 3 tokens: down to 0.99998963), so batches with a text shorter than
  ``MIXED_PRECISION_MIN_TOKENS`` run in float32. :class:`~.runner.EncoderRunner` checks the result
  on each model before keeping it.

RoBERTa and XLM-RoBERTa differ from BERT only in where their positions start (``pad_token_id + 1``;
right padding makes that ``offset + arange`` for every real token, as transformers' cumulative
count of non-pad tokens gives) and in having a single token type.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from hearth_llm import kernels

from . import compiled_block, varlen_attention
from .linear import Linear

SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
_ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "relu": "relu"}
_KEY_PREFIXES = ("bert.", "roberta.", "model.")
# In mixed precision, a batch runs in float32 if any text has fewer tokens (special tokens included):
# measured on all-MiniLM-L6-v2, 300 random texts per length, the worst cosine to float32 was
# 0.9999902 at 3 tokens and 0.9999949–0.9999966 from 4 to 14.
MIXED_PRECISION_MIN_TOKENS = 5


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
    """Where the real tokens of a right-padded ``[batch, length]`` batch sit once packed, and which
    texts attention takes together: each run of consecutive texts of equal length, or on CUDA in
    half precision all texts at once through flash attention's variable-length kernel
    (``cu_seqlens``: where each text starts in the packed tokens, and the end).

    >>> PackedLayout.from_mask(torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]])).runs
    [(0, 1, 3), (3, 2, 2)]
    >>> PackedLayout.from_lengths([3, 2, 2], torch.device("cpu")).runs        # the same, no mask read back
    [(0, 1, 3), (3, 2, 2)]
    """

    batch: int
    length: int
    token_index: torch.Tensor | None     # [num_tokens] flat padded position of each token; None: no padding
    runs: list[tuple[int, int, int]]     # (first packed token, num_texts, length) of each equal-length run
    cu_seqlens: torch.Tensor | None = None   # int32 [batch + 1] on a CUDA device; None: attention by runs

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor) -> PackedLayout:
        """From a mask on any device; reads it back to the host (a sync on CUDA)."""
        return cls.from_lengths(attention_mask.sum(dim=1).tolist(), attention_mask.device)

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device) -> PackedLayout:
        """From the texts' token counts, known on the host: on CUDA nothing waits for the device
        (the index tensors go up with non-blocking copies from pinned memory)."""
        batch, length = len(lengths), max(lengths)
        runs, start = [], 0
        for text_length, texts in itertools.groupby(lengths):
            num_texts = len(list(texts))
            if text_length:
                runs.append((start, num_texts, text_length))
            start += num_texts * text_length
        token_index = cu_seqlens = None
        if any(text_length != length for text_length in lengths):
            is_real = torch.arange(length).expand(batch, length) < torch.tensor(lengths).unsqueeze(1)
            token_index = _to_device(is_real.flatten().nonzero().squeeze(1), device)
        if device.type == "cuda" and all(lengths):
            starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            cu_seqlens = _to_device(starts, device)
        return cls(batch, length, token_index, runs, cu_seqlens)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """``[batch * length, ...]`` → ``[num_tokens, ...]``."""
        return padded if self.token_index is None else padded.index_select(0, self.token_index)

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, width]`` → ``[batch * length, width]``, zeros where padding is."""
        if self.token_index is None:
            return packed
        padded = packed.new_zeros(self.batch * self.length, packed.shape[1])
        return padded.index_copy_(0, self.token_index, packed)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def packed_attention(qkv: torch.Tensor, layout: PackedLayout, num_heads: int) -> torch.Tensor:
    """``[num_tokens, 3 * width]`` packed query, key and value → ``[num_tokens, width]``: where
    :func:`~.varlen_attention.can_run` allows it, one cuDNN attention over texts that all have one
    length or one variable-length flash attention over all texts; else one unmasked attention per
    run of equal-length texts."""
    width = qkv.shape[1] // 3
    head_dim = width // num_heads
    if layout.cu_seqlens is not None and varlen_attention.can_run(qkv, head_dim):
        if len(layout.runs) == 1:
            _, num_texts, length = layout.runs[0]
            out = varlen_attention.attend_equal_lengths(qkv, num_texts, length, num_heads)
            if out is not None:
                return out
        query, key, value = qkv.view(-1, 3, num_heads, head_dim).unbind(1)
        out = varlen_attention.attend(query, key, value, layout.cu_seqlens, layout.length)
        if out is not None:
            return out.reshape(-1, width)
    attended = qkv.new_empty(qkv.shape[0], width)
    for start, num_texts, length in layout.runs:
        end = start + num_texts * length
        block = qkv[start:end].view(num_texts, length, 3, num_heads, head_dim)
        query, key, value = block.permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(query, key, value)            # [texts, heads, length, head_dim]
        attended[start:end].view(num_texts, length, num_heads, head_dim).copy_(out.transpose(1, 2))
    return attended


def add_and_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm(residual + x)`` through the kernels' one dispatch point: on CUDA one Triton kernel
    (the sum rounded to its dtype, then normed in float32, as the two eager ops do), on the CPU
    the same two torch ops as before."""
    return kernels.layer_norm(x, norm.weight, norm.bias, norm.eps, residual=residual)[0]


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qkv_proj = Linear(hidden, 3 * hidden)
        self.out_proj = Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.up_proj = Linear(hidden, config.intermediate_size, activation=config.activation)
        self.down_proj = Linear(config.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.compiled_half = None   # compiled_block.compiled_block(), set by BertEncoder.use_compiled_blocks

    def forward(self, hidden: torch.Tensor, layout: PackedLayout, bf16_out_proj: bool = False,
                bf16_mlp: bool = False) -> torch.Tensor:
        """``hidden`` is ``[num_tokens, hidden]``, packed as ``layout`` says; the flags pick the
        layers' bf16 copies (see :meth:`BertEncoder.prepack`)."""
        attended = packed_attention(self.qkv_proj(hidden), layout, self.num_heads)
        if self.compiled_half is not None and hidden.is_cuda:
            return self.compiled_half(hidden, attended, *self._second_half_weights())
        hidden = add_and_norm(self.out_proj(attended, in_bf16=bf16_out_proj), hidden, self.attention_norm)
        return add_and_norm(self.down_proj(self.up_proj(hidden, in_bf16=bf16_mlp), in_bf16=bf16_mlp), hidden,
                            self.output_norm)

    def _second_half_weights(self) -> tuple:
        return (self.out_proj.weight, self.out_proj.bias, self.attention_norm.weight, self.attention_norm.bias,
                self.up_proj.weight, self.up_proj.bias, self.down_proj.weight, self.down_proj.bias,
                self.output_norm.weight, self.output_norm.bias, self.output_norm.eps, self.up_proj.activation)


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
        self.is_mixed_precision = False     # set by prepack

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None, layout: PackedLayout | None = None) -> torch.Tensor:
        """``input_ids`` and ``attention_mask`` are ``[batch, length]``, right-padded; returns
        ``[batch, length, hidden]`` with zeros at the padded positions. Without
        ``token_type_ids`` every token is of type 0 (one text); a cross-encoder's pairs pass theirs.
        ``layout``: the mask's :class:`PackedLayout` if the caller has it (saves reading the mask back)."""
        batch, length = input_ids.shape
        if layout is None:
            layout = PackedLayout.from_mask(attention_mask)
        offset = self.config.position_offset
        # Right padding puts every real token at the position it would have alone.
        positions = torch.arange(offset, offset + length, device=input_ids.device).expand(batch, length)
        input_ids, positions = layout.pack(input_ids.reshape(-1)), layout.pack(positions.reshape(-1))
        token_types = (self.token_type_embeddings.weight[0] if token_type_ids is None
                       else self.token_type_embeddings(layout.pack(token_type_ids.reshape(-1))))
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions) + token_types
        hidden = self.embedding_norm(hidden)
        shortest = min(run_length for _, _, run_length in layout.runs)
        in_bf16 = self.is_mixed_precision and shortest >= MIXED_PRECISION_MIN_TOKENS
        for layer in self.layers:
            hidden = layer(hidden, layout, bf16_out_proj=in_bf16, bf16_mlp=in_bf16 and layer is self.layers[-1])
        return layout.pad(hidden).view(batch, length, -1)

    def use_compiled_blocks(self, enabled: bool = True) -> bool:
        """On CUDA in float16/bfloat16, run each layer's second half compiled
        (:mod:`~.compiled_block`); whether it is on (False elsewhere, without a compiler, or not ``enabled``)."""
        weight = self.word_embeddings.weight
        block = None
        if enabled and weight.is_cuda and weight.dtype in (torch.float16, torch.bfloat16):
            block = compiled_block.compiled_block()
        for layer in self.layers:
            layer.compiled_half = block
        return block is not None

    def prepack(self, mixed_precision: bool = False) -> None:
        """Pack every dense layer for oneDNN; with ``mixed_precision`` (a float32 model on a CPU
        with bf16 matmuls), the layers that tolerate it best get bf16 copies (module docstring)."""
        last = self.layers[-1]
        for_bf16 = {id(layer.out_proj) for layer in self.layers} | {id(last.up_proj), id(last.down_proj)}
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(with_bf16_copy=mixed_precision and id(module) in for_bf16)
        self.is_mixed_precision = any(module.has_bf16_copy for module in self.modules() if isinstance(module, Linear))

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype, device: torch.device) -> BertEncoder:
        """Build from ``path/config.json`` and its safetensors weights (one file or sharded)."""
        with open(Path(path) / "config.json", encoding="utf-8") as file:
            config = BertConfig.from_dict(json.load(file))
        return cls.from_weights(config, read_safetensors(Path(path)), dtype, device)

    @classmethod
    def from_weights(cls, config: BertConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device) -> BertEncoder:
        """Build from checkpoint tensors named as transformers names them, prefix cut."""
        encoder = cls(config)
        encoder.load_state_dict(_our_state_dict(weights, config.num_hidden_layers))
        encoder.to(device=device, dtype=dtype).eval()
        encoder.requires_grad_(False)
        encoder.prepack()
        return encoder


def has_safetensors(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def read_safetensors(path: Path, prefixes: tuple[str, ...] = _KEY_PREFIXES) -> dict[str, torch.Tensor]:
    """Every tensor of ``path``'s safetensors (one file or sharded), the model-class prefix
    (``bert.``, ``roberta.``...) cut from its name."""
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
                tensors[_canonical_key(key, prefixes)] = file.get_tensor(key)
    return tensors


def _canonical_key(key: str, prefixes: tuple[str, ...] = _KEY_PREFIXES) -> str:
    for prefix in prefixes:
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
