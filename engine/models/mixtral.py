"""Mixtral (8x7B, 8x22B): Mistral's attention (no biases, ``sliding_window`` on every layer when
set) with a sparse MoE block on every layer: ``num_local_experts`` experts of
``intermediate_size``, top ``num_experts_per_tok``, always renormalised.

Hub checkpoints name the block ``block_sparse_moe`` and an expert's gate, up and down ``w1``,
``w3``, ``w2``. Ignored because they only matter in training: ``router_jitter_noise`` (HF
applies it only in training mode), ``router_aux_loss_coef``, ``output_router_logits``,
``attention_dropout``.

GGUF: llama.cpp writes Mixtral as architecture ``llama`` with expert tensors and
``llama.expert_count``; such a file loads as this model (a variant of the ``llama`` entry).
"""
from __future__ import annotations

from hearth_llm.engine.loader.gguf_spec import GGUFArchitecture

from .moe import MoeDecoderModel
from .registry import register_model


def _has_experts(metadata) -> bool:
    return (metadata.model_value("expert_count", 0) or 0) > 0


def _gguf_config_fields(metadata) -> dict:
    # llama.cpp runs a `llama` file with experts as Mixtral does: softmax over every expert, top
    # `expert_used_count`, renormalised; each expert as wide as `feed_forward_length`.
    return dict(num_local_experts=metadata.model_value("expert_count"),
                num_experts_per_tok=metadata.model_value("expert_used_count"))


# llama.cpp writes Mixtral as architecture `llama` (q/k rows permuted like Llama's), every layer's
# experts stacked per projection: ffn_gate_exps [E, I, H] holds each expert's w1, and so on.
_GGUF = GGUFArchitecture(
    config_class="MixtralConfig", permuted_qk=True, applies_to=_has_experts, config_fields=_gguf_config_fields,
    tensor_names={"ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.w1",
                  "ffn_up_exps": "block_sparse_moe.experts.w3", "ffn_down_exps": "block_sparse_moe.experts.w2"},
)


@register_model("MixtralForCausalLM", model_types=("mixtral",), gguf={"llama": _GGUF})
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
