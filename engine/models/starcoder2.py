"""StarCoder2: Llama's layout with LayerNorm (with bias) instead of RMSNorm, biases on every linear
(``use_bias``), a plain GELU-tanh MLP (``c_fc`` then ``c_proj``, no gate) and a sliding window on
every layer (``sliding_window``). The norms' epsilon is ``norm_epsilon``.

llama.cpp's StarCoder2 files keep no sliding window (its runtime has none for this architecture),
so a GGUF loads without one, as llama.cpp runs it.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .arch import ArchConfig
from .attention import Attention
from .decoder import DecoderModel
from .mlp import MLP
from .norms import LayerNorm
from .registry import register_model


@dataclass(slots=True)
class Starcoder2Arch(ArchConfig):
    use_bias: bool = True

    @classmethod
    def from_hf_config(cls, config, **overrides) -> "Starcoder2Arch":
        # ArchConfig checks and reads the norm epsilon as rms_norm_eps or layer_norm_eps.
        return super(Starcoder2Arch, cls).from_hf_config(_NormEpsilonAlias(config), **overrides)


class _NormEpsilonAlias:
    """``config`` read through, with ``norm_epsilon`` also answering as ``layer_norm_eps``."""

    def __init__(self, config) -> None:
        self._config = config
        self.layer_norm_eps = config.norm_epsilon

    def __getattr__(self, name):
        return getattr(self._config, name)


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, arch: Starcoder2Arch, layer_index: int, rotary, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = Attention.from_arch(arch, layer_index, rotary, prefix=f"{prefix}.self_attn")
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.use_bias,
                       prefix=f"{prefix}.mlp", owner=arch.architecture)
        self.input_layernorm = LayerNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = LayerNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta), residual)
        return self.mlp(hidden), residual


_STARCODER2_GGUF = GGUFArchitecture(
    config_class="Starcoder2Config", tensor_names={"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    # Every StarCoder2 release has biases (use_bias defaults to True); a file without them fails
    # the checkpoint check by name.
    config_fields=lambda metadata: {"norm_epsilon": metadata.model_value("attention.layer_norm_epsilon")})


@register_model("Starcoder2ForCausalLM", model_types=("starcoder2",), gguf={"starcoder2": _STARCODER2_GGUF})
class Starcoder2ForCausalLM(DecoderModel):
    arch_class = Starcoder2Arch
    layer_class = Starcoder2DecoderLayer
    checkpoint_renames = {"c_fc": "up_proj", "c_proj": "down_proj"}

    @classmethod
    def arch_fields(cls, config) -> dict:
        use_bias = bool(config.use_bias)
        return dict(use_bias=use_bias, attention_bias=use_bias, o_proj_bias=use_bias)

    def make_norm(self) -> nn.Module:
        return LayerNorm(self.arch.hidden_size, self.arch.rms_norm_eps)
