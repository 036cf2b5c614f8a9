"""OLMo 2, Granite, Command-R and StarCoder2 (and the extras GLM-4 and SmolLM3) load from GGUF files and give HF transformers' greedy
tokens for the model the file was converted from.

Each tiny HF model is written as GGUF the way llama.cpp's convert_hf_to_gguf.py writes it: tensor
names from the gguf package's own name map, Granite's and SmolLM3's q/k rows permuted for
llama.cpp's interleaved rotary (both convert through LlamaModel), GLM-4's rotary width, the family's scalars under llama.cpp's keys
(Granite's four ``*_scale`` keys, Command-R's ``logit_scale``), F32 tensors so the comparison is
exact.
"""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import SmolLM3Config, Starcoder2Config

from hearth_llm.engine import SamplingParams

from conftest import TINY_COMMON, hf_greedy, random_prompts
from test_models_olmo_granite_cohere_starcoder import CONFIGS
from test_models_smollm3_glm4_ministral import CONFIGS as EXTRA_CONFIGS
from gguf_writer import write_shape_fields, write_tensors_and_close, write_tiny_tokenizer
from model_equality import save_tiny_model

# A tiny config -> llama.cpp's architecture.
GGUF_CASES = {
    "olmo2": (CONFIGS["olmo2"], gguf.MODEL_ARCH.OLMO2),
    "granite": (CONFIGS["granite"], gguf.MODEL_ARCH.GRANITE),
    "cohere": (CONFIGS["cohere"], gguf.MODEL_ARCH.COMMAND_R),
    # llama.cpp keeps no sliding window for StarCoder2, so the HF model has none either.
    "starcoder2": (lambda: Starcoder2Config(**TINY_COMMON, norm_epsilon=1e-5, architectures=["Starcoder2ForCausalLM"]),
                   gguf.MODEL_ARCH.STARCODER2),
    "glm4": (EXTRA_CONFIGS["glm4"], gguf.MODEL_ARCH.GLM4),
    # llama.cpp's fixed NoPE step of 4: layer 4 of 4 runs without rotary.
    "smollm3": (lambda: SmolLM3Config(**{**TINY_COMMON, "num_hidden_layers": 4}, architectures=["SmolLM3ForCausalLM"]),
                gguf.MODEL_ARCH.SMOLLM3),
}
PERMUTED_QK = (gguf.MODEL_ARCH.GRANITE, gguf.MODEL_ARCH.SMOLLM3)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's LlamaModel.permute does to q/k rows (HF rotate-half -> interleaved pairs)."""
    halves = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def write_gguf(hf_dir, path, architecture: gguf.MODEL_ARCH):
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[architecture])
    _write_hyperparameters(writer, config, architecture)
    write_tiny_tokenizer(writer, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))

    def llama_cpp_form(hf_name, tensor):
        if architecture in PERMUTED_QK and hf_name.endswith("q_proj.weight"):
            return llama_cpp_permute(tensor, config["num_attention_heads"])
        if architecture in PERMUTED_QK and hf_name.endswith("k_proj.weight"):
            return llama_cpp_permute(tensor, config["num_key_value_heads"])
        return tensor

    write_tensors_and_close(writer, load_file(hf_dir / "model.safetensors"), architecture, config, llama_cpp_form)
    return path


def _write_hyperparameters(writer, config: dict, architecture) -> None:
    write_shape_fields(writer, config)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    if "rms_norm_eps" in config:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    for key in ("layer_norm_eps", "norm_epsilon"):
        if key in config:
            writer.add_layer_norm_eps(config[key])
    if architecture == gguf.MODEL_ARCH.GRANITE:
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
    if architecture == gguf.MODEL_ARCH.COMMAND_R:
        writer.add_logit_scale(config["logit_scale"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if architecture == gguf.MODEL_ARCH.GLM4:
        writer.add_rope_dimension_count(int(config["head_dim"] * config["rope_parameters"]["partial_rotary_factor"]))


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_gguf_file_matches_hf(name, tmp_path, make_llm, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the GGUF conversion cache lands under ~/.cache
    make_config, architecture = GGUF_CASES[name]
    hf_dir = save_tiny_model(make_config(), tmp_path / "hf", seed=3)
    path = write_gguf(hf_dir, tmp_path / f"{name}.gguf", architecture)
    llm = make_llm(path, dtype="float32")
    prompts = random_prompts(3, [1, 19, 40], seed=31)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_dir, prompt, GREEDY.max_tokens), f"{len(prompt)} tokens"


def test_granite_gguf_keeps_its_multipliers(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    from hearth_llm.engine.loader.gguf import load_gguf

    hf_dir = save_tiny_model(CONFIGS["granite"](), tmp_path / "hf", seed=3)
    config = load_gguf(write_gguf(hf_dir, tmp_path / "g.gguf", gguf.MODEL_ARCH.GRANITE), torch.float32,
                       cache_dir=tmp_path / "cache", progress=False).config
    expected = CONFIGS["granite"]()
    for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        assert np.isclose(getattr(config, field), getattr(expected, field)), field
