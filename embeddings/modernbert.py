"""ModernBERT (answerdotai/ModernBERT and the embedders built on it) in plain torch, for embedding only.

What is special about it, against BERT: pre-norm layers (the first has no attention norm) and a
final norm; no position embeddings but rotary ones with two bases — ``global_rope_theta``
(160k) on the global layers, ``local_rope_theta`` (10k) on the local ones; local layers attend
only to keys within ``local_attention // 2`` tokens (every ``global_attn_every_n_layers``-th
layer, from the first, is global, or as ``layer_types`` lists); a GeGLU feed-forward
(``Wo(act(x_in) * x_gate)`` from one ``Wi`` projection); by default no biases anywhere, norms
included (``attention_bias``, ``mlp_bias``, ``norm_bias`` are honoured when set).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .bert import PackedLayout, read_safetensors
from .linear import Linear
from .rotary import inverse_frequencies, packed_positions, packed_rotary_attention, rotary_tables

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_python": lambda x: F.gelu(x),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}


@dataclass(slots=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    activation: str
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    is_global: list[bool]          # per layer: full attention (True) or local
    half_window: int               # local layers see keys within this distance
    global_rope_theta: float
    local_rope_theta: float

    @classmethod
    def from_dict(cls, config: dict) -> ModernBertConfig:
        """Both transformers 5's ``layer_types``/``rope_parameters`` and the hub's
        ``global_attn_every_n_layers``/``global_rope_theta``/``local_rope_theta``; raises
        ``ValueError`` naming a field this encoder cannot run exactly."""
        if config.get("model_type") != "modernbert":
            raise ValueError(f"model_type {config.get('model_type')!r} is not 'modernbert'")
        activation = config.get("hidden_activation", "gelu")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"ModernBERT hidden_activation {activation!r} is not supported; "
                             f"supported: {sorted(_ACTIVATIONS)}")
        num_layers = int(config.get("num_hidden_layers", 22))
        if config.get("layer_types"):
            types = list(config["layer_types"])
            unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
            if unknown or len(types) != num_layers:
                raise ValueError(f"ModernBERT layer_types {types!r} must list 'full_attention' or "
                                 f"'sliding_attention' for each of the {num_layers} layers")
            is_global = [kind == "full_attention" for kind in types]
        else:
            every = int(config.get("global_attn_every_n_layers", 3))
            is_global = [i % every == 0 for i in range(num_layers)]
        global_theta, local_theta = _rope_thetas(config)
        return cls(vocab_size=int(config.get("vocab_size", 50368)), hidden_size=int(config["hidden_size"]),
                   num_hidden_layers=num_layers, num_attention_heads=int(config["num_attention_heads"]),
                   intermediate_size=int(config["intermediate_size"]), activation=activation,
                   norm_eps=float(config.get("norm_eps", 1e-5)), norm_bias=bool(config.get("norm_bias", False)),
                   attention_bias=bool(config.get("attention_bias", False)),
                   mlp_bias=bool(config.get("mlp_bias", False)), is_global=is_global,
                   half_window=int(config.get("local_attention", 128)) // 2,
                   global_rope_theta=global_theta, local_rope_theta=local_theta)


def _rope_thetas(config: dict) -> tuple[float, float]:
    rope = config.get("rope_parameters") or {}
    for kind in ("full_attention", "sliding_attention"):
        rope_type = (rope.get(kind) or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"ModernBERT rope_parameters[{kind!r}] rope_type {rope_type!r} is not supported")
    if config.get("rope_scaling"):
        raise ValueError(f"ModernBERT rope_scaling {config['rope_scaling']!r} is not supported")
    global_theta = (rope.get("full_attention") or {}).get("rope_theta", config.get("global_rope_theta", 160000.0))
    local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", config.get("local_rope_theta", 10000.0))
    # ModernBERT's own code uses the global base on local layers when local_rope_theta is null.
    return float(global_theta), float(global_theta if local_theta is None else local_theta)


class ModernBertLayer(nn.Module):
    def __init__(self, config: ModernBertConfig, index: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.is_global = config.is_global[index]
        self.half_window = None if self.is_global else config.half_window
        self.activation = _ACTIVATIONS[config.activation]
        norm = lambda: nn.LayerNorm(hidden, eps=config.norm_eps, bias=config.norm_bias)  # noqa: E731
        self.attention_norm = norm() if index > 0 else nn.Identity()
        self.qkv_proj = Linear(hidden, 3 * hidden, bias=config.attention_bias)
        self.out_proj = Linear(hidden, hidden, bias=config.attention_bias)
        self.mlp_norm = norm()
        self.up_gate_proj = Linear(hidden, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, hidden, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor, layout: PackedLayout, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(self.attention_norm(hidden))
        hidden = hidden + self.out_proj(packed_rotary_attention(qkv, layout, self.num_heads, cos, sin,
                                                                half_window=self.half_window))
        up, gate = self.up_gate_proj(self.mlp_norm(hidden)).chunk(2, dim=-1)
        return hidden + self.down_proj(self.activation(up) * gate)


class ModernBertEncoder(nn.Module):
    """Token ids → last hidden states (after the final norm).

    >>> encoder = ModernBertEncoder.from_pretrained(path, dtype=torch.float32, device=torch.device("cpu"))
    >>> encoder(input_ids, attention_mask).shape           # [batch, length, hidden]
    """

    is_mixed_precision = False    # no bf16 mixing calibrated for this architecture

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=config.norm_eps, bias=config.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(hidden, eps=config.norm_eps, bias=config.norm_bias)
        head_dim = hidden // config.num_attention_heads
        self.register_buffer("global_inv_freq", inverse_frequencies(head_dim, config.global_rope_theta),
                             persistent=False)
        self.register_buffer("local_inv_freq", inverse_frequencies(head_dim, config.local_rope_theta),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                layout: PackedLayout | None = None) -> torch.Tensor:
        """Right-padded ``[batch, length]`` → ``[batch, length, hidden]``, zeros at padding;
        ``layout`` as :meth:`~.bert.BertEncoder.forward` takes it."""
        batch, length = input_ids.shape
        if layout is None:
            layout = PackedLayout.from_mask(attention_mask)
        tokens = layout.pack(input_ids.reshape(-1))
        hidden = self.embedding_norm(self.word_embeddings(tokens))
        positions = packed_positions(layout, tokens.device)
        tables = {True: rotary_tables(positions, self.global_inv_freq, hidden.dtype),
                  False: rotary_tables(positions, self.local_inv_freq, hidden.dtype)}
        for layer in self.layers:
            hidden = layer(hidden, layout, *tables[layer.is_global])
        return layout.pad(self.final_norm(hidden)).view(batch, length, -1)

    def prepack(self, mixed_precision: bool = False) -> None:
        """Pack the dense layers for oneDNN (mixed precision is not offered for this architecture)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype, device: torch.device) -> ModernBertEncoder:
        with open(Path(path) / "config.json", encoding="utf-8") as file:
            config = ModernBertConfig.from_dict(json.load(file))
        weights = read_safetensors(Path(path), prefixes=("model.",))
        encoder = cls(config)
        encoder.load_state_dict(_our_state_dict(weights, config))
        encoder.to(device=device, dtype=dtype).eval()
        encoder.requires_grad_(False)
        encoder.prepack()
        return encoder


def _our_state_dict(weights: dict[str, torch.Tensor], config: ModernBertConfig) -> dict[str, torch.Tensor]:
    def take(key: str) -> torch.Tensor:
        if key not in weights:
            raise ValueError(f"the checkpoint has no tensor {key!r}; is this a ModernBERT encoder?")
        return weights[key]

    norm_params = ("weight", "bias") if config.norm_bias else ("weight",)
    state = {"word_embeddings.weight": take("embeddings.tok_embeddings.weight")}
    for param in norm_params:
        state[f"embedding_norm.{param}"] = take(f"embeddings.norm.{param}")
        state[f"final_norm.{param}"] = take(f"final_norm.{param}")
    for i in range(config.num_hidden_layers):
        theirs, ours = f"layers.{i}.", f"layers.{i}."
        for param in norm_params:
            if i > 0:
                state[ours + f"attention_norm.{param}"] = take(theirs + f"attn_norm.{param}")
            state[ours + f"mlp_norm.{param}"] = take(theirs + f"mlp_norm.{param}")
        for ours_name, theirs_name, has_bias in (("qkv_proj", "attn.Wqkv", config.attention_bias),
                                                 ("out_proj", "attn.Wo", config.attention_bias),
                                                 ("up_gate_proj", "mlp.Wi", config.mlp_bias),
                                                 ("down_proj", "mlp.Wo", config.mlp_bias)):
            for param in ("weight", "bias") if has_bias else ("weight",):
                state[ours + f"{ours_name}.{param}"] = take(theirs + f"{theirs_name}.{param}")
    return state
