"""Qwen2-MoE and Qwen3-MoE load from GGUF files and give HF transformers' greedy tokens for the
model the file was converted from.

Each tiny HF model is written as llama.cpp's convert_hf_to_gguf.py writes it: every layer's
experts stacked into one tensor per projection (``ffn_gate_exps`` ``[E, I, H]`` ...), the router
as ``ffn_gate_inp``, Qwen2-MoE's shared expert as ``*_shexp``, the expert counts and sizes under
llama.cpp's keys, F32 tensors so the comparison is exact. llama.cpp runs every layer sparse, so
the HF models do too.
"""
from __future__ import annotations

import json
import re

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from hearth_llm.engine import LLM, SamplingParams

from conftest import TINY_COMMON, hf_greedy, random_prompts
from model_equality import save_tiny_model
from gguf_writer import write_shape_fields, write_tensors_and_close, write_tiny_tokenizer

EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {
    # llama.cpp renormalises Qwen3-MoE's top-k weights unless expert_weights_norm says otherwise.
    "qwen3moe": (lambda: Qwen3MoeConfig(**TINY_COMMON, **EXPERTS, head_dim=32, norm_topk_prob=True,
                                        tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"]),
                 gguf.MODEL_ARCH.QWEN3MOE, None),
    "qwen3moe-unnormalised": (lambda: Qwen3MoeConfig(**TINY_COMMON, **EXPERTS, head_dim=16, norm_topk_prob=False,
                                                     tie_word_embeddings=True, architectures=["Qwen3MoeForCausalLM"]),
                              gguf.MODEL_ARCH.QWEN3MOE, False),
    "qwen2moe": (lambda: Qwen2MoeConfig(**TINY_COMMON, **EXPERTS, shared_expert_intermediate_size=48,
                                        tie_word_embeddings=False, architectures=["Qwen2MoeForCausalLM"]),
                 gguf.MODEL_ARCH.QWEN2MOE, None),
}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
_EXPERT = re.compile(r"(?P<stem>model\.layers\.\d+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight")


def stacked_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert hub tensors stacked as llama.cpp's converter stacks them (``…experts.gate_proj.weight``)."""
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in state_dict.items():
        if match := _EXPERT.fullmatch(name):
            stacks.setdefault(f"{match['stem']}.{match['proj']}.weight", {})[int(match["expert"])] = tensor
        else:
            out[name] = tensor
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def write_gguf(hf_dir, path, architecture, weights_norm):
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[architecture])
    write_shape_fields(writer, config)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_expert_count(config.get("num_experts", config.get("num_local_experts")))  # renamed in transformers 5
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in config:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if weights_norm is not None:
        writer.add_expert_weights_norm(weights_norm)
    write_tiny_tokenizer(writer)
    write_tensors_and_close(writer, stacked_experts(load_file(hf_dir / "model.safetensors")), architecture, config)
    return path


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_gguf_file_matches_hf(name, tmp_path, make_llm, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the GGUF conversion cache lands under ~/.cache
    make_config, architecture, weights_norm = CASES[name]
    hf_dir = save_tiny_model(make_config(), tmp_path / "hf", seed=5)
    path = write_gguf(hf_dir, tmp_path / f"{name}.gguf", architecture, weights_norm)
    llm = make_llm(path, dtype="float32")
    assert type(llm.engine.runner.model.layers[0].mlp).__name__ == "SparseMoeBlock"
    prompts = random_prompts(3, [1, 19, 40], seed=31)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_dir, prompt, GREEDY.max_tokens), f"{len(prompt)} tokens"


def test_moe_gguf_with_sigmoid_gating_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    make_config, architecture, _ = CASES["qwen3moe"]
    hf_dir = save_tiny_model(make_config(), tmp_path / "hf")
    add_expert_used_count = gguf.GGUFWriter.add_expert_used_count

    def with_sigmoid_gating(writer, value):  # as llama.cpp writes DeepSeek-V3-style routers
        add_expert_used_count(writer, value)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)

    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_used_count", with_sigmoid_gating)
    path = write_gguf(hf_dir, tmp_path / "sigmoid.gguf", architecture, None)
    with pytest.raises(ValueError, match="expert_gating_func"):
        LLM(str(path), show_progress=False)
