"""What the GGUF loader needs to know about one llama.cpp architecture.

A model file declares it when it registers (``engine/models/registry.py``)::

    @register_model("Gemma2ForCausalLM", model_types=("gemma2",), gguf={"gemma2": GGUFArchitecture(
        config_class="Gemma2Config",
        tensor_names={"post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"},
        config_fields=lambda metadata: {"attn_logit_softcapping": metadata.model_value("attn_logit_softcapping")},
        transform_tensor=lambda name, tensor, config: tensor - 1 if name.endswith("norm.weight") else tensor,
    )})
    class Gemma2ForCausalLM(DecoderModel): ...

The loader reads ``general.architecture`` from the file and looks the entry up, so supporting a
new GGUF architecture never means editing the loader. llama.cpp writes some models under another
architecture's name (Mixtral is ``llama`` with expert tensors and ``llama.expert_count``); such a
model registers a variant of that name with ``applies_to``, which the loader prefers when it holds::

    @register_model("MixtralForCausalLM", gguf={"llama": GGUFArchitecture(
        config_class="MixtralConfig", applies_to=lambda metadata: metadata.model_value("expert_count", 0) > 0)})
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# llama.cpp's names of the tensors most architectures share, and their Hugging Face modules.
COMMON_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
COMMON_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFArchitecture:
    """One llama.cpp architecture (``general.architecture``) as the loader reads it.

    config_class: the transformers config class (by name, imported on a first load only) whose
        defaults fill in what the metadata does not say, e.g. ``"LlamaConfig"``.
    permuted_qk: llama.cpp's converter reorders q/k rows for its interleaved rotary (Llama,
        Mistral); the loader undoes it.
    tensor_names / global_tensor_names: llama.cpp tensor name -> Hugging Face module, on top of
        (and overriding) :data:`COMMON_LAYER_TENSOR_NAMES` / :data:`COMMON_GLOBAL_TENSOR_NAMES`.
    config_fields: ``metadata -> dict`` of extra config keyword arguments (soft caps, windows...);
        ``metadata.model_value("key", default)`` reads ``<architecture>.key``.
    transform_tensor: ``(hf_name, dense tensor, config) -> tensor`` for tensors llama.cpp stores
        differently from Hugging Face (Gemma's norms hold ``1 + w``); applied after dequantizing.
        Tensors it may change are never kept in their quantized blocks.
    ignored_tensors: llama.cpp tensor names to skip (e.g. precomputed rope tables).
    applies_to: ``metadata -> bool`` for a variant registered under another model's architecture
        name; the loader uses the first registered variant it holds for, else the plain entry.
    """

    config_class: str
    permuted_qk: bool = False
    tensor_names: Mapping[str, str] = field(default_factory=dict)
    global_tensor_names: Mapping[str, str] = field(default_factory=dict)
    config_fields: Callable[[Any], dict] | None = None
    transform_tensor: Callable[[str, Any, Any], Any] | None = None
    ignored_tensors: frozenset[str] = frozenset()
    applies_to: Callable[[Any], bool] | None = None

    @property
    def layer_tensor_names(self) -> dict[str, str]:
        return {**COMMON_LAYER_TENSOR_NAMES, **self.tensor_names}

    @property
    def all_global_tensor_names(self) -> dict[str, str]:
        return {**COMMON_GLOBAL_TENSOR_NAMES, **self.global_tensor_names}
