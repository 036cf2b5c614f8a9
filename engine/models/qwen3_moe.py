"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm per head) with a
sparse MoE block on the layers ``decoder_sparse_step`` / ``mlp_only_layers`` pick, dense MLPs of
``intermediate_size`` on the others.

Routing: softmax over ``num_experts``, top ``num_experts_per_tok``, renormalised when
``norm_topk_prob``. Its sliding window, when ``use_sliding_window``, covers every layer (HF
Qwen3-MoE ignores ``max_window_layers``). Ignored because they only matter in training:
``router_aux_loss_coef``, ``output_router_logits``, ``attention_dropout``.
"""
from __future__ import annotations

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .moe import (GGUF_EXPERT_TENSOR_NAMES, MoeDecoderModel, checked_mlp_only_layers, checked_sparse_step,
                  config_num_experts, gguf_moe_config_fields, sparse_layer_pattern)
from .registry import register_model

# llama.cpp runs every layer sparse and renormalises the top-k weights unless the file says otherwise.
_GGUF = GGUFArchitecture(config_class="Qwen3MoeConfig", tensor_names=GGUF_EXPERT_TENSOR_NAMES,
                         config_fields=lambda metadata: gguf_moe_config_fields(metadata, renormalize_by_default=True))


@register_model("Qwen3MoeForCausalLM", model_types=("qwen3_moe",), gguf={"qwen3moe": _GGUF})
class Qwen3MoeForCausalLM(MoeDecoderModel):
    @classmethod
    def moe_fields(cls, config) -> dict:
        num_experts = config_num_experts(config)
        return dict(
            has_qk_norm=True, o_proj_bias=bool(getattr(config, "attention_bias", False)), max_window_layers=None,
            layer_types=None, num_experts=num_experts, num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
            sparse_layers=sparse_layer_pattern(config.num_hidden_layers, num_experts, checked_sparse_step(config),
                                               checked_mlp_only_layers(config)),
        )

