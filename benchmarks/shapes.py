"""The model shapes the benchmarks build with random weights: HF config fields by shape name.

Plain data (no torch, no transformers), so a peer's process (``vllm_side.py``) reads the very same
shapes without importing anything of ours that would load torch first.

>>> SHAPES["llama3-8b"]["hidden_size"]
4096
"""
from __future__ import annotations

import copy

SHAPES = {
    "qwen3-0.6b": dict(architecture="Qwen3ForCausalLM", num_hidden_layers=28, hidden_size=1024,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6),
    "llama3-8b": dict(architecture="LlamaForCausalLM", num_hidden_layers=32, hidden_size=4096,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                      vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5),
    # bf16: 30.53B parameters, 56.9 GiB; KV 96 KiB per token (48 layers x K and V x 4 heads x 128 x 2 B).
    "qwen3-30b-a3b": dict(architecture="Qwen3MoeForCausalLM", num_hidden_layers=48, hidden_size=2048,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False,
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # bf16: 46.70B parameters, 87.0 GiB; KV 128 KiB per token. With the default 40 GiB of KV, ~127 GiB
    # of the H200's ~139 GiB before activations.
    "mixtral-8x7b": dict(architecture="MixtralForCausalLM", num_hidden_layers=32, hidden_size=4096,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                         num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, tie_word_embeddings=False,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                         sliding_window=None),
}

# Not benchmarks: a shape above at toy sizes, the same architecture and options, so the same code path
# runs on the CPU in seconds (tests/test_bench_throughput.py). The vocabulary covers the workload's
# token ids (0..10000).
_TINY_SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=10240, max_position_embeddings=4096)


def _tiny(shape: str, **sizes) -> dict:
    return copy.deepcopy({**SHAPES[shape], **_TINY_SIZES, **sizes})


SHAPES.update({
    "tiny-qwen3": _tiny("qwen3-0.6b"),
    "tiny-qwen3-moe": _tiny("qwen3-30b-a3b", moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "tiny-mixtral": _tiny("mixtral-8x7b", intermediate_size=32, num_local_experts=4),
})

# HF ``model_type`` of each architecture, for a config.json written without transformers (vLLM's side).
MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "LlamaForCausalLM": "llama",
               "MixtralForCausalLM": "mixtral"}


def shape_fields(shape: str, max_model_len: int | None = None) -> dict:
    """``SHAPES[shape]``, its ``max_position_embeddings`` raised to ``max_model_len`` where shorter
    (the Llama-3-8B shape's 8,192 for the 8,704 a long-context run needs; the layers, and so the
    cost of every token, are the same). Both sides of a comparison build from these fields.

    >>> shape_fields("llama3-8b", 8704)["max_position_embeddings"], shape_fields("llama3-8b")["max_position_embeddings"]
    (8704, 8192)
    """
    fields = dict(SHAPES[shape])
    if max_model_len is not None and fields["max_position_embeddings"] < max_model_len:
        fields["max_position_embeddings"] = max_model_len
    return fields


def config_json(shape: str, max_model_len: int | None = None, dtype: str = "bfloat16") -> dict:
    """A config.json for ``shape`` (what an HF checkpoint of it holds), with the token ids the
    benchmarks' placeholder tokenizer uses (bos 0, eos 1, pad 0)."""
    fields = shape_fields(shape, max_model_len)
    architecture = fields.pop("architecture")
    return dict(fields, architectures=[architecture], model_type=MODEL_TYPES[architecture], torch_dtype=dtype,
                bos_token_id=0, eos_token_id=1, pad_token_id=0)
