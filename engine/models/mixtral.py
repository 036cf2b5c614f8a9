"""Mixtral (8x7B, 8x22B): Mistral's attention (no biases, ``sliding_window`` on every layer when
set) with a sparse MoE block on every layer: ``num_local_experts`` experts of
``intermediate_size``, top ``num_experts_per_tok``, always renormalised.

Hub checkpoints name the block ``block_sparse_moe`` and an expert's gate, up and down ``w1``,
``w3``, ``w2``. Ignored because they only matter in training: ``router_jitter_noise`` (HF
applies it only in training mode), ``router_aux_loss_coef``, ``output_router_logits``,
``attention_dropout``.
"""
from __future__ import annotations

from .moe import MoeDecoderModel
from .registry import register_model


@register_model("MixtralForCausalLM", model_types=("mixtral",))
class MixtralForCausalLM(MoeDecoderModel):
    checkpoint_renames = {"block_sparse_moe": "mlp"}
    expert_names = {"w1": "gate", "w3": "up", "w2": "down"}

    @classmethod
    def moe_fields(cls, config) -> dict:
        return dict(
            num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.intermediate_size, norm_topk_prob=True, layer_types=None,
            sparse_layers=(True,) * config.num_hidden_layers,
        )
