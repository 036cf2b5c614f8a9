"""Llama family (Llama 2/3, SmolLM2, and the base every other model here extends)."""
from __future__ import annotations

import torch
from torch import nn

from .arch import ArchConfig
from .layers import AttentionMetadata, DecoderLayer, RMSNorm, RotaryEmbedding, repack_for_cpu

# Our fused parameters and the Hugging Face parameters stacked into them, in order.
STACKED_PARAMS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        # An explicit weight skips the random init, which the checkpoint overwrites anyway; on the
        # meta device that init (normal_) first imports torch._dynamo, most of a second of load time.
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        rotary = RotaryEmbedding(arch)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, rotary) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def materialize_buffers(self, dtype: torch.dtype) -> None:
        """After building on the meta device: recompute the rotary table and re-tie the head."""
        rotary = self.layers[0].self_attn.rotary
        device = self.embed_tokens.weight.device
        rotary.cos_sin_cache = RotaryEmbedding(self.arch).cos_sin_cache.to(device=device, dtype=dtype)
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def arch_from_hf_config(cls, config) -> ArchConfig:
        return ArchConfig.from_hf_config(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, stacking q/k/v and gate/up into our fused layers.

        On the CPU, bf16 linear layers are then repacked for fast matmuls (:func:`repack_for_cpu`),
        so this is the model's last setup step.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        stacked: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for hf_name, tensor in state_dict.items():
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            fused = _fused_name(name)
            if fused is not None:
                fused_name, index = fused
                stacked.setdefault(fused_name, []).append((index, tensor))
                continue
            if name not in params:
                raise ValueError(f"checkpoint has weight {hf_name!r} that {type(self).__name__} does not expect")
            _copy_checked(params[name], tensor, hf_name)
            loaded.add(name)
        for fused_name, parts in stacked.items():
            _copy_checked(params[fused_name], torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]), fused_name)
            loaded.add(fused_name)
        missing = set(params) - loaded - ({"lm_head.weight"} if self.arch.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
        repack_for_cpu(self)


def _fused_name(name: str) -> tuple[str, int] | None:
    for fused, parts in STACKED_PARAMS.items():
        for index, part in enumerate(parts):
            marker = f".{part}."
            if marker in name:
                return name.replace(marker, f".{fused}."), index
    return None


def _copy_checked(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}")
    param.copy_(tensor)
