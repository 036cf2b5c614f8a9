"""Gemma, Gemma 2, Gemma 3 and Phi-3 load from GGUF files and give HF transformers' greedy tokens
for the model the file was converted from.

Each tiny HF model is written the way llama.cpp's convert_hf_to_gguf.py writes it: tensor names
from the gguf package's own name map, Gemma's norm weights stored as ``1 + w``, the family's
settings under llama.cpp's keys, F32 tensors so the comparison is exact. Where llama.cpp keeps a
setting nowhere (Gemma 2/3's ``query_pre_attn_scalar``: it uses ``head_dim`` below 27B; Gemma 3's
window pattern and local rope base, read from optional keys with llama.cpp's defaults), the HF
model uses llama.cpp's value.
"""
from __future__ import annotations

import json

import gguf
import pytest
from safetensors.torch import load_file

from hearth_llm.engine import SamplingParams

from conftest import hf_greedy, random_prompts
from gguf_writer import write_shape_fields, write_tensors_and_close, write_tiny_tokenizer
from model_equality import save_tiny_model
from test_models_gemma_phi import FULL, SLIDING, make_config

SIX_LAYERS = dict(num_hidden_layers=6, layer_types=[SLIDING] * 5 + [FULL])  # llama.cpp's Gemma 3 pattern

# A tiny config (name in test_models_gemma_phi and overrides) -> llama.cpp's architecture.
GGUF_CASES = {
    "gemma": ("gemma", {}, gguf.MODEL_ARCH.GEMMA),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}, gguf.MODEL_ARCH.GEMMA2),
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 16, **SIX_LAYERS}, gguf.MODEL_ARCH.GEMMA3),
    "phi3": ("phi3-window", {}, gguf.MODEL_ARCH.PHI3),
}
GEMMA_ARCHS = (gguf.MODEL_ARCH.GEMMA, gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def write_gguf(hf_dir, path, architecture: gguf.MODEL_ARCH):
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[architecture])
    _write_hyperparameters(writer, config, architecture)
    write_tiny_tokenizer(writer)

    def llama_cpp_form(hf_name, tensor):
        if architecture in GEMMA_ARCHS and hf_name.endswith("norm.weight"):
            return tensor + 1  # llama.cpp's Gemma converters store 1 + w
        return tensor

    write_tensors_and_close(writer, load_file(hf_dir / "model.safetensors"), architecture, config, llama_cpp_form)
    return path


def _write_hyperparameters(writer, config: dict, architecture) -> None:
    write_shape_fields(writer, config)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if architecture == gguf.MODEL_ARCH.GEMMA2:
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    if architecture == gguf.MODEL_ARCH.GEMMA3:
        full = config["rope_parameters"][FULL]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window(config["sliding_window"])
    if architecture == gguf.MODEL_ARCH.PHI3:
        rope = config["rope_parameters"]
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        writer.add_sliding_window(config["sliding_window"])


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_gguf_file_matches_hf(name, tmp_path, make_llm, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the GGUF conversion cache lands under ~/.cache
    config_name, overrides, architecture = GGUF_CASES[name]
    hf_dir = save_tiny_model(make_config(config_name, **overrides), tmp_path / "hf", seed=3)
    path = write_gguf(hf_dir, tmp_path / f"{name}.gguf", architecture)
    llm = make_llm(path, dtype="float32")
    prompts = random_prompts(3, [1, 19, 40], seed=31)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_dir, prompt, GREEDY.max_tokens), f"{len(prompt)} tokens"
