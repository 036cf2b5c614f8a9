"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (biases on q, k and v only,
from ``qkv_bias``) with a sparse MoE block plus a shared expert on the layers
``decoder_sparse_step`` / ``mlp_only_layers`` pick, dense MLPs of ``intermediate_size`` on the others.

The shared expert (a gated MLP of ``shared_expert_intermediate_size``) runs on every token and is
scaled by ``sigmoid(shared_expert_gate(x))`` before it joins the routed experts' sum. Routing:
softmax, top ``num_experts_per_tok``, renormalised when ``norm_topk_prob`` (off by default).
Windows follow ``layer_types``. Ignored because they only matter in training:
``router_aux_loss_coef``, ``output_router_logits``, ``attention_dropout``.
"""
from __future__ import annotations

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .moe import (GGUF_EXPERT_TENSOR_NAMES, GGUF_SHARED_EXPERT_TENSOR_NAMES, MoeDecoderModel,
                  checked_mlp_only_layers, checked_sparse_step, config_num_experts, gguf_moe_config_fields,
                  sparse_layer_pattern)
from .registry import register_model

# llama.cpp runs every layer sparse, with the shared expert, and does not renormalise by default.
_GGUF = GGUFArchitecture(config_class="Qwen2MoeConfig",
                         tensor_names={**GGUF_EXPERT_TENSOR_NAMES, **GGUF_SHARED_EXPERT_TENSOR_NAMES},
                         config_fields=lambda metadata: gguf_moe_config_fields(metadata, renormalize_by_default=False))


@register_model("Qwen2MoeForCausalLM", model_types=("qwen2_moe",), gguf={"qwen2moe": _GGUF})
class Qwen2MoeForCausalLM(MoeDecoderModel):
    @classmethod
    def moe_fields(cls, config) -> dict:
        num_experts = config_num_experts(config)
        return dict(
            attention_bias=bool(getattr(config, "qkv_bias", True)), o_proj_bias=False,
            num_experts=num_experts, num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
            shared_expert_intermediate_size=config.shared_expert_intermediate_size,
            sparse_layers=sparse_layer_pattern(config.num_hidden_layers, num_experts, checked_sparse_step(config),
                                               checked_mlp_only_layers(config)),
        )
