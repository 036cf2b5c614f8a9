"""Mixtral loads from GGUF files and gives HF transformers' greedy tokens for the model the file was
converted from.

llama.cpp's convert_hf_to_gguf.py writes Mixtral as architecture ``llama``: q/k rows permuted as
for Llama, each layer's experts stacked into one tensor per projection (``ffn_gate_exps`` from
every expert's ``w1``, ``ffn_up_exps`` from ``w3``, ``ffn_down_exps`` from ``w2``), the router as
``ffn_gate_inp``, and the expert counts as ``llama.expert_count`` / ``llama.expert_used_count``.
Files converted before early 2024 hold one tensor per expert (``blk.N.ffn_gate.E.weight``).
F32 tensors, so the comparison is exact.
"""
from __future__ import annotations

import json
import re

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import MixtralConfig

from conftest import TINY_COMMON
from gguf_writer import write_shape_fields, write_tensors_and_close, write_tiny_tokenizer
from model_equality import check_alone_and_batched, check_prefix_hits, save_tiny_model

_EXPERT = re.compile(r"(?P<stem>model\.layers\.\d+\.block_sparse_moe\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])\.weight")


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Llama (and Mixtral) q/k rows."""
    halves = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


# Before llama.cpp stacked experts (files converted until early 2024), each was its own tensor.
_LEGACY_EXPERT_NAMES = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}


def as_llama_cpp_writes_it(state_dict: dict[str, torch.Tensor], config: dict,
                           legacy_experts: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """q/k permuted, per-expert tensors stacked under ``…experts.w1`` etc. (gguf's name map
    knows those as ``ffn_gate_exps``...); with ``legacy_experts`` given, experts go there instead
    under their old llama.cpp names (``blk.N.ffn_gate.E.weight``)."""
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in state_dict.items():
        if (match := _EXPERT.fullmatch(name)) and legacy_experts is not None:
            layer = match["stem"].split(".")[2]
            legacy_experts[f"blk.{layer}.{_LEGACY_EXPERT_NAMES[match['proj']]}.{match['expert']}.weight"] = tensor
        elif match:
            stacks.setdefault(f"{match['stem']}.{match['proj']}.weight", {})[int(match["expert"])] = tensor
        elif name.endswith("q_proj.weight"):
            out[name] = llama_cpp_permute(tensor, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            out[name] = llama_cpp_permute(tensor, config["num_key_value_heads"])
        else:
            out[name] = tensor
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def write_mixtral_gguf(hf_dir, path, expert_count=None, legacy=False):
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    write_shape_fields(writer, config)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_expert_count(config["num_local_experts"] if expert_count is None else expert_count)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    write_tiny_tokenizer(writer)
    legacy_experts = {} if legacy else None
    tensors = as_llama_cpp_writes_it(load_file(hf_dir / "model.safetensors"), config, legacy_experts)
    for name, tensor in (legacy_experts or {}).items():
        writer.add_tensor(name, tensor.float().numpy())
    write_tensors_and_close(writer, tensors, gguf.MODEL_ARCH.LLAMA, config)
    return path


@pytest.fixture(scope="module")
def mixtral_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral-gguf")
    config = MixtralConfig(**TINY_COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                           architectures=["MixtralForCausalLM"])
    hf_dir = save_tiny_model(config, root / "hf", seed=7)
    return hf_dir, write_mixtral_gguf(hf_dir, root / "mixtral.gguf")


def test_llama_gguf_with_experts_loads_as_mixtral_and_matches_hf(mixtral_gguf, tmp_path, make_llm, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the GGUF conversion cache lands under ~/.cache
    hf_dir, path = mixtral_gguf
    llm = make_llm(path, dtype="float32")
    model = llm.engine.runner.model
    assert type(model).__name__ == "MixtralForCausalLM"
    assert type(model.layers[0].mlp).__name__ == "SparseMoeBlock"
    assert model.layers[0].mlp.experts.num_experts == 4 and model.layers[0].mlp.experts.top_k == 2
    # The checks compare with HF run on hf_dir; the engine reads only the GGUF file (and its cache).
    from_gguf = lambda _, **kwargs: make_llm(path, dtype="float32", **kwargs)  # noqa: E731
    check_alone_and_batched(hf_dir, from_gguf)
    check_prefix_hits(hf_dir, from_gguf)


def test_mixtral_gguf_with_one_tensor_per_expert_matches_hf(mixtral_gguf, tmp_path, make_llm, monkeypatch):
    """The layout of Mixtral GGUFs converted before llama.cpp stacked experts (blk.N.ffn_gate.E.weight)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    hf_dir, _ = mixtral_gguf
    path = write_mixtral_gguf(hf_dir, tmp_path / "legacy.gguf", legacy=True)
    names = {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    assert "blk.1.ffn_gate.3.weight" in names and "blk.1.ffn_gate_exps.weight" not in names
    check_alone_and_batched(hf_dir, lambda _, **kwargs: make_llm(path, dtype="float32", **kwargs))


def test_llama_gguf_without_experts_still_loads_as_llama(tmp_path, make_llm, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    from transformers import LlamaConfig

    hf_dir = save_tiny_model(LlamaConfig(**TINY_COMMON, tie_word_embeddings=False,
                                         architectures=["LlamaForCausalLM"]), tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(tmp_path / "llama.gguf", gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    write_shape_fields(writer, config)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    write_tiny_tokenizer(writer)
    write_tensors_and_close(writer, as_llama_cpp_writes_it(load_file(hf_dir / "model.safetensors"), config),
                            gguf.MODEL_ARCH.LLAMA, config)
    llm = make_llm(tmp_path / "llama.gguf", dtype="float32")
    assert type(llm.engine.runner.model).__name__ == "LlamaForCausalLM"


def test_mixtral_gguf_whose_expert_count_disagrees_with_its_tensors_is_refused(mixtral_gguf, tmp_path, monkeypatch):
    from hearth_llm.engine import LLM

    monkeypatch.setenv("HOME", str(tmp_path))
    hf_dir, _ = mixtral_gguf
    path = write_mixtral_gguf(hf_dir, tmp_path / "wrong.gguf", expert_count=8)
    with pytest.raises(ValueError, match=r"wrong\.gguf: weight 'model\.layers\.0\.block_sparse_moe\.gate\.weight' "
                                         r"has shape \(4, 64\).*makes it \(8, 64\)"):
        LLM(str(path), show_progress=False)
