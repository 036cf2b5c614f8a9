"""GLM-4 (0414): Llama with a norm after attention and after the MLP as well as before each,
GPT-J style (interleaved) rotary on the first ``partial_rotary_factor`` (0.5) of each head,
biases on q, k and v only, and a checkpoint that stores gate/up fused (``mlp.gate_up_proj``)."""
from __future__ import annotations

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

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


def _gguf_config_fields(metadata) -> dict:
    # llama.cpp stores the rotary width; HF the fraction of the head it covers.
    head_dim = metadata.model_value("attention.key_length", None) or (
        metadata.model_value("embedding_length") // metadata.model_value("attention.head_count"))
    return {"partial_rotary_factor": metadata.model_value("rope.dimension_count", head_dim // 2) / head_dim}


_GLM4_GGUF = GGUFArchitecture(config_class="Glm4Config", config_fields=_gguf_config_fields, tensor_names={
    "post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj"})


@register_model("Glm4ForCausalLM", model_types=("glm4",), gguf={"glm4": _GLM4_GGUF})
class Glm4ForCausalLM(DecoderModel):
    layer_class = Glm4DecoderLayer

    @classmethod
    def arch_fields(cls, config) -> dict:
        return dict(is_neox_style=False)
