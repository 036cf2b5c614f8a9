"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama whose checkpoint stores q/k/v and gate/up fused
(``qkv_proj``, ``gate_up_proj``: the fused layers' loaders split them into their shards), rotary
on the first ``partial_rotary_factor`` of each head, a window on every layer when
``sliding_window`` is set, and longrope.

Longrope, as HF runs it: a forward pass uses the long factors for every token when the sequence it
is run for is longer than ``original_max_position_embeddings`` (L), the short ones otherwise; and
``generate`` drops its cache when a sequence first grows past L, recomputing every token with the
long factors. So after n tokens, all of a sequence's keys are in one regime, long iff n > L. We
keep that invariant per sequence: the model picks each sequence's regime from its length
(``meta.seq_lens``), and the engine recomputes a sequence whose length crosses L and keeps the two
regimes' blocks apart in the prefix cache (:meth:`Phi3ForCausalLM.kv_regime`). The rotary table
holds L short rows, then the long ones: a token at position p uses row p or L + p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .arch import ArchConfig
from .decoder import DecoderModel
from .registry import register_model
from .rotary import RotaryEmbedding, rope_parameters

LONG_ROPE_REGIME = "longrope-long"


def _phi3_gguf_fields(metadata) -> dict:
    head_dim = metadata.model_value("embedding_length") // metadata.model_value("attention.head_count")
    return dict(partial_rotary_factor=metadata.model_value("rope.dimension_count", head_dim) / head_dim,
                sliding_window=metadata.model_value("attention.sliding_window", None))


@dataclass(slots=True)
class Phi3Arch(ArchConfig):
    long_rope_inv_freq: torch.Tensor | None = None   # longrope only: the long factors' frequencies
    original_max_position_embeddings: int | None = None


def long_rope_frequencies(config, original_length: int) -> torch.Tensor:
    """HF's long-factor frequencies: what ``_compute_longrope_parameters`` returns past L."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=original_length + 1)
    return inv_freq.float()


class LongRopeRotary(RotaryEmbedding):
    """A rotary table of L short-factor rows followed by the long-factor rows."""

    def __init__(self, short_inv_freq, long_inv_freq, original_length: int, max_position: int,
                 attention_scaling: float) -> None:
        self.long_inv_freq = long_inv_freq.detach().to("cpu", torch.float32)
        self.original_length = original_length
        super().__init__(short_inv_freq, max_position, attention_scaling)

    def _table(self) -> torch.Tensor:
        positions = torch.arange(self.max_position, dtype=torch.float32)
        short, long = self.inv_freq.to(positions.device), self.long_inv_freq.to(positions.device)
        freqs = torch.cat((torch.outer(positions[:self.original_length], short), torch.outer(positions, long)))
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling

    def rope_positions(self, positions: torch.Tensor, meta) -> torch.Tensor:
        """Each token's row: ``p`` in a sequence of at most L tokens, ``L + p`` in a longer one."""
        seq_lens = meta.seq_lens if meta.seq_lens is not None else meta.context_lens
        if meta.max_query_len > 1:  # else one token per sequence (decode graphs rely on it)
            query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
            seq_lens = torch.repeat_interleave(seq_lens, query_lens, output_size=positions.shape[0])
        return positions + (seq_lens > self.original_length) * self.original_length


@register_model("Phi3ForCausalLM", model_types=("phi3",), gguf={"phi3": GGUFArchitecture(
    config_class="Phi3Config", tensor_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    config_fields=_phi3_gguf_fields)})
class Phi3ForCausalLM(DecoderModel):
    arch_class = Phi3Arch
    supported_rope_types = frozenset({"default", "longrope"})

    @classmethod
    def arch_fields(cls, config) -> dict:
        # Phi-3 has no bias anywhere and one window for every layer (HF ignores any layer_types).
        fields = dict(attention_bias=False, layer_types=None)
        original = _original_length(config)
        if original is not None:
            if not isinstance(original, int) or not 0 < original <= config.max_position_embeddings:
                raise ValueError(f"config.json: longrope original_max_position_embeddings={original!r} must be an "
                                 f"integer in [1, max_position_embeddings={config.max_position_embeddings}]")
            fields.update(original_max_position_embeddings=original,
                          long_rope_inv_freq=long_rope_frequencies(config, original))
        return fields

    def make_rotaries(self) -> dict[str, RotaryEmbedding]:
        arch = self.arch
        if arch.long_rope_inv_freq is None:
            return super().make_rotaries()
        rotary = LongRopeRotary(arch.rope_inv_freq, arch.long_rope_inv_freq, arch.original_max_position_embeddings,
                                arch.max_position_embeddings, arch.rope_attention_scaling)
        return dict.fromkeys({arch.layer_type(i) for i in range(arch.num_hidden_layers)}, rotary)

    @property
    def long_rope(self) -> LongRopeRotary | None:
        rotary = self.layers[0].self_attn.rotary
        return rotary if isinstance(rotary, LongRopeRotary) else None

    def forward(self, input_ids, positions, kv_caches, meta):
        if self.long_rope is not None:
            positions = self.long_rope.rope_positions(positions, meta)
        return super().forward(input_ids, positions, kv_caches, meta)

    def kv_regime(self, num_tokens: int) -> str | None:
        """The regime a sequence of ``num_tokens`` tokens computes its keys in: the engine keeps a
        sequence's cached KV in one regime and never shares blocks between regimes."""
        if self.long_rope is not None and num_tokens > self.long_rope.original_length:
            return LONG_ROPE_REGIME
        return None


def _original_length(config) -> int | None:
    """L of a longrope config (None otherwise); HF's config keeps it at the top level and in rope_parameters."""
    params = rope_parameters(config)
    if params["rope_type"] != "longrope":
        return None
    return params.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
