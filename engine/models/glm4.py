"""GLM-4 (0414): Llama with a norm after attention and after the MLP as well as before each,
GPT-J style (interleaved) rotary on the first ``partial_rotary_factor`` (0.5) of each head,
biases on q, k and v only, and a checkpoint that stores gate/up fused (``mlp.gate_up_proj``)."""
from __future__ import annotations

from .decoder import DecoderLayer, DecoderModel
from .norms import RMSNorm
from .registry import register_model


class Glm4DecoderLayer(DecoderLayer):
    def __init__(self, arch, layer_index: int, rotary, prefix: str = "") -> None:
        super().__init__(arch, layer_index, rotary, prefix)
        self.post_self_attn_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


@register_model("Glm4ForCausalLM", model_types=("glm4",))
class Glm4ForCausalLM(DecoderModel):
    layer_class = Glm4DecoderLayer

    @classmethod
    def arch_fields(cls, config) -> dict:
        return dict(is_neox_style=False)
