"""Tensor parallelism over NCCL: needs two CUDA devices (skipped otherwise; not run yet: the lent
GPU machine has one). Greedy tokens of TP=2 equal TP=1 (fp32) on tiny models of every split the
CPU tests check over gloo: Llama and Qwen3, with and without CUDA graphs (each rank captures its
own, all-reduces included); the MoE families (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared
expert: the Triton expert kernel on each rank's slice); LoRA adapters per request (each rank's
cut of A/B, the shrink through the planned CUDA kernels); a GGUF file of every block type kept as
blocks (the Triton block kernels on each rank's rows and whole-block input slices) and an AWQ
checkpoint (W4G128 on 128-groups). A killed worker stops the engine with EngineDeadError.

    python -m pytest -q tests/test_tensor_parallel_gpu.py      # on a machine with >= 2 GPUs
"""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, Qwen3Config

from hearth_llm.engine import LLM, EngineDeadError, LoRARequest, SamplingParams

from conftest import TINY_COMMON, random_prompts
from model_equality import save_tiny_model
from test_tensor_parallel_moe import CONFIGS as MOE_CONFIGS  # the CPU tests' MoE models

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY_COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
    "qwen3": lambda: Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=True,
                                 architectures=["Qwen3ForCausalLM"]),
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
GPU = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB", show_progress=False)


def _tokens(llm: LLM, prompts, **kwargs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False, **kwargs)]


def _tp2_equals_tp1(path, prompts, **kwargs) -> None:
    with LLM(str(path), **GPU, **kwargs) as single:
        expected = _tokens(single, prompts)
    with LLM(str(path), tensor_parallel_size=2, **GPU, **kwargs) as llm:
        assert _tokens(llm, prompts) == expected
        assert _tokens(llm, prompts[:1]) == expected[:1]


@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_over_nccl_equals_tp1(name, cuda_graphs, tmp_path):
    path = save_tiny_model(CONFIGS[name](), tmp_path / name, seed=len(name))
    _tp2_equals_tp1(path, random_prompts(6, [3, 40, 17, 1], seed=5), cuda_graphs=cuda_graphs)


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_tp2_moe_over_nccl_equals_tp1(name, tmp_path):
    path = save_tiny_model(MOE_CONFIGS[name](), tmp_path / name, seed=len(name))
    _tp2_equals_tp1(path, random_prompts(6, [3, 40, 17, 1], seed=5), cuda_graphs=True)


def _write_adapter(base_config: LlamaConfig, path, seed: int, r: int = 4) -> str:
    """A PEFT-format LoRA directory with random A/B on every projection (peft is not on the GPU image)."""
    hidden, inter = base_config.hidden_size, base_config.intermediate_size
    head_dim = hidden // base_config.num_attention_heads
    kv_rows = base_config.num_key_value_heads * head_dim
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv_rows, hidden), "self_attn.v_proj": (kv_rows, hidden),
              "self_attn.o_proj": (hidden, hidden), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base_config.num_hidden_layers):
        for module, (rows, columns) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, columns, generator=generator) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, r, generator=generator) * 0.3
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))
    return str(path)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_tp2_lora_over_nccl_equals_tp1(cuda_graphs, tmp_path):
    config = LlamaConfig(**{**TINY_COMMON, "num_key_value_heads": 1}, architectures=["LlamaForCausalLM"])
    path = save_tiny_model(config, tmp_path / "base", seed=3)
    adapters = [LoRARequest(name, _write_adapter(config, tmp_path / name, seed)) for seed, name in enumerate("ab")]
    prompts = random_prompts(6, [5, 17, 9], seed=22)
    loras = [None, adapters[0], adapters[1], adapters[0], None, adapters[1]]
    engine = dict(enable_lora=True, max_loras=1, max_lora_rank=4, cuda_graphs=cuda_graphs, **GPU)
    with LLM(str(path), **engine) as single:
        expected = _tokens(single, prompts, lora_request=loras)
        assert expected[1] != _tokens(single, prompts[1:2])[0], "adapter a must change the answer"
    with LLM(str(path), tensor_parallel_size=2, **engine) as llm:
        assert _tokens(llm, prompts, lora_request=loras) == expected


def test_tp2_gguf_blocks_and_awq_over_nccl_equal_tp1(tmp_path):
    from test_tensor_parallel_quant import SPLITTABLE, build_int4_dirs, write_gguf

    prompts = random_prompts(4, [5, 17, 1, 9], seed=21)
    _tp2_equals_tp1(write_gguf(tmp_path / "splittable.gguf", SPLITTABLE), prompts, quantization="gguf")
    _tp2_equals_tp1(build_int4_dirs(tmp_path / "int4")["awq"], prompts)


def test_killed_gpu_worker_stops_the_engine(tmp_path):
    path = save_tiny_model(CONFIGS["llama"](), tmp_path / "llama")
    llm = LLM(str(path), tensor_parallel_size=2, cuda_graphs=False, **GPU)
    try:
        os.kill(llm.engine.runner.pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    finally:
        llm.close()
