"""NomicBert (nomic-embed-text v1/v1.5) in plain torch, for embedding only.

What is special about it, against BERT: no position embeddings but rotary ones on every layer
(full head width, half-split, base ``rotary_emb_base``, 1000 for v1.5); no biases in the attention
or the feed-forward block; a SwiGLU feed-forward (``fc2(fc11(x) * silu(fc12(x)))``); post-norm
layers as in BERT. The token-type embedding of type 0 is added to every token.

Both config shapes are read: nomic's own (``n_embd``, ``n_layer``, ``rotary_emb_base``... loaded by
its remote code) and transformers' native ``NomicBertConfig`` (``hidden_size``, ``rope_parameters``);
and both weight layouts (``encoder.layers.N.attn.Wqkv`` / ``mlp.fc11`` or transformers'
``layers.N.self_attn.q_proj`` / ``mlp.up_proj``). Fields of nomic's config that change the math
and are not implemented here (pre-norm, parallel blocks, biases, partial or interleaved rotary,
rotary scaling, xPos, other attention scalings, MoE layers) raise ``ValueError`` naming the field.
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

# nomic's config fields that must hold these values for this encoder to be exact.
_REQUIRED_VALUES = {"prenorm": False, "causal": False, "qkv_proj_bias": False, "mlp_fc1_bias": False,
                    "mlp_fc2_bias": False, "rotary_emb_interleaved": False, "rotary_emb_fraction": 1.0,
                    "rotary_scaling_factor": None, "rotary_emb_scale_base": None, "use_rms_norm": False,
                    "moe_every_n_layers": 0, "parallel_block": False, "scale_attn_weights": True,
                    "scale_attn_by_inverse_layer_idx": False}
_GATE_ACTIVATIONS = {"swiglu": "silu", "silu": "silu", "gelu": "gelu", "geglu": "gelu"}


@dataclass(slots=True)
class NomicBertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    type_vocab_size: int
    layer_norm_eps: float
    rope_theta: float
    gate_activation: str      # "silu" (SwiGLU) or "gelu"

    @classmethod
    def from_dict(cls, config: dict) -> NomicBertConfig:
        """Raises ``ValueError`` naming a field this encoder cannot run exactly."""
        if config.get("model_type") != "nomic_bert":
            raise ValueError(f"model_type {config.get('model_type')!r} is not 'nomic_bert'")
        for name, required in _REQUIRED_VALUES.items():
            value = config.get(name, required)
            if value != required and not (name == "moe_every_n_layers" and not value):
                raise ValueError(f"NomicBert config field {name}={value!r} is not supported (needs {required!r})")
        activation = config.get("activation_function", config.get("hidden_act", "swiglu"))
        if activation not in _GATE_ACTIVATIONS:
            raise ValueError(f"NomicBert activation {activation!r} is not supported; "
                             f"supported: {sorted(_GATE_ACTIVATIONS)}")
        hidden = int(config.get("hidden_size", config.get("n_embd", 768)))
        return cls(vocab_size=int(config.get("vocab_size", 30528)), hidden_size=hidden,
                   num_hidden_layers=int(config.get("num_hidden_layers", config.get("n_layer", 12))),
                   num_attention_heads=int(config.get("num_attention_heads", config.get("n_head", 12))),
                   intermediate_size=int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden),
                   type_vocab_size=int(config.get("type_vocab_size", 2)),
                   layer_norm_eps=float(config.get("layer_norm_eps", config.get("layer_norm_epsilon", 1e-12))),
                   rope_theta=_rope_theta(config), gate_activation=_GATE_ACTIVATIONS[activation])


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"NomicBert rope_parameters rope_type {rope['rope_type']!r} is not supported")
    if config.get("rope_scaling"):
        raise ValueError(f"NomicBert rope_scaling {config['rope_scaling']!r} is not supported")
    return float(rope.get("rope_theta", config.get("rope_theta", config.get("rotary_emb_base", 1000.0))))


class NomicBertLayer(nn.Module):
    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.gate_activation = config.gate_activation
        self.qkv_proj = Linear(hidden, 3 * hidden, bias=False)
        self.out_proj = Linear(hidden, hidden, bias=False)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.up_gate_proj = Linear(hidden, 2 * inner, bias=False)      # [up; gate], one matmul
        self.down_proj = Linear(inner, hidden, bias=False)
        self.output_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, layout: PackedLayout, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attended = packed_rotary_attention(self.qkv_proj(hidden), layout, self.num_heads, cos, sin)
        hidden = self.attention_norm(hidden + self.out_proj(attended))
        up, gate = self.up_gate_proj(hidden).chunk(2, dim=-1)
        gated = up * (F.silu(gate) if self.gate_activation == "silu" else F.gelu(gate))
        return self.output_norm(hidden + self.down_proj(gated))


class NomicBertEncoder(nn.Module):
    """Token ids → last hidden states, as :class:`~.bert.BertEncoder` does for BERT.

    >>> encoder = NomicBertEncoder.from_pretrained(path, dtype=torch.float32, device=torch.device("cpu"))
    >>> encoder(input_ids, attention_mask).shape           # [batch, length, hidden]
    """

    is_mixed_precision = False    # no bf16 mixing calibrated for this architecture

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embedding_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(NomicBertLayer(config) for _ in range(config.num_hidden_layers))
        head_dim = config.hidden_size // config.num_attention_heads
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, config.rope_theta), persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                layout: PackedLayout | None = None) -> torch.Tensor:
        """Right-padded ``[batch, length]`` → ``[batch, length, hidden]``, zeros at padding;
        ``layout`` as :meth:`~.bert.BertEncoder.forward` takes it."""
        batch, length = input_ids.shape
        if layout is None:
            layout = PackedLayout.from_mask(attention_mask)
        tokens = layout.pack(input_ids.reshape(-1))
        hidden = self.embedding_norm(self.word_embeddings(tokens) + self.token_type_embeddings.weight[0])
        cos, sin = rotary_tables(packed_positions(layout, tokens.device), self.inv_freq, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, layout, cos, sin)
        return layout.pad(hidden).view(batch, length, -1)

    def prepack(self, mixed_precision: bool = False) -> None:
        """Pack the dense layers for oneDNN (mixed precision is not offered for this architecture)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype, device: torch.device) -> NomicBertEncoder:
        with open(Path(path) / "config.json", encoding="utf-8") as file:
            config = NomicBertConfig.from_dict(json.load(file))
        weights = read_safetensors(Path(path), prefixes=("nomic_bert.", "bert.", "model."))
        config.vocab_size = weights[_find(weights, "embeddings.word_embeddings.weight")].shape[0]
        encoder = cls(config)
        encoder.load_state_dict(_our_state_dict(weights, config.num_hidden_layers))
        encoder.to(device=device, dtype=dtype).eval()
        encoder.requires_grad_(False)
        encoder.prepack()
        return encoder


def _find(weights: dict, *names: str) -> str:
    for name in names:
        if name in weights:
            return name
    raise ValueError(f"the checkpoint has none of {names}; is this a NomicBert encoder?")


def _our_state_dict(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """nomic's names (``encoder.layers.N.attn.Wqkv``...) or transformers'
    (``layers.N.self_attn.q_proj``...) → ours."""
    def take(*names: str) -> torch.Tensor:
        return weights[_find(weights, *names)]

    state = {"word_embeddings.weight": take("embeddings.word_embeddings.weight"),
             "token_type_embeddings.weight": take("embeddings.token_type_embeddings.weight")}
    for param in ("weight", "bias"):
        state[f"embedding_norm.{param}"] = take(f"emb_ln.{param}", f"embeddings.LayerNorm.{param}")
    for i in range(num_layers):
        nomic, hf, ours = f"encoder.layers.{i}.", f"layers.{i}.", f"layers.{i}."
        if nomic + "attn.Wqkv.weight" in weights:
            state[ours + "qkv_proj.weight"] = weights[nomic + "attn.Wqkv.weight"]
        else:
            state[ours + "qkv_proj.weight"] = torch.cat([take(hf + f"self_attn.{n}_proj.weight") for n in "qkv"])
        state[ours + "out_proj.weight"] = take(nomic + "attn.out_proj.weight", hf + "self_attn.o_proj.weight")
        state[ours + "up_gate_proj.weight"] = torch.cat([take(nomic + "mlp.fc11.weight", hf + "mlp.up_proj.weight"),
                                                         take(nomic + "mlp.fc12.weight", hf + "mlp.gate_proj.weight")])
        state[ours + "down_proj.weight"] = take(nomic + "mlp.fc2.weight", hf + "mlp.down_proj.weight")
        for param in ("weight", "bias"):
            state[ours + f"attention_norm.{param}"] = take(nomic + f"norm1.{param}",
                                                           hf + f"post_attention_layernorm.{param}")
            state[ours + f"output_norm.{param}"] = take(nomic + f"norm2.{param}", hf + f"post_mlp_layernorm.{param}")
    return state
