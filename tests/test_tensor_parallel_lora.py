"""Tensor parallelism with LoRA on the CPU (two gloo ranks, fp32): adapters are checked against
the whole model in the driver, sent to the workers once, and each rank keeps its cut (column-
parallel: A whole, B's columns of its rows; row-parallel: A's columns of its input slice, the
shrink summed by the layer's all-reduce). Greedy tokens equal HF + PEFT and the single-process
engine, per request, in mixed batches with the base model, when adapters swap through fewer
slots than adapters, and for Phi-3, whose adapter B spans the fused q/k/v rows.
"""
from __future__ import annotations

import pytest
from transformers import LlamaConfig, Phi3Config

from hearth_llm.engine import LLM, LoRARequest

from conftest import TINY_COMMON, assert_pool_whole, random_prompts
from model_equality import save_tiny_model
from test_lora import GREEDY, make_adapter, peft_greedy

CPU = dict(device="cpu", dtype="float32", show_progress=False, block_size=8, enable_lora=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """One key/value head for two ranks (replicated: each rank's B keeps the same k/v columns)."""
    root = tmp_path_factory.mktemp("tp_lora_llama")
    config = LlamaConfig(**{**TINY_COMMON, "num_key_value_heads": 1}, architectures=["LlamaForCausalLM"])
    base = save_tiny_model(config, root / "base", seed=3)
    adapters = {"a": make_adapter(base, root / "a", seed=1),
                "b": make_adapter(base, root / "b", seed=2, r=8, alpha=4, use_rslora=True,
                                  target_modules=["q_proj", "v_proj", "down_proj"])}
    return base, adapters


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def test_tp2_mixed_adapters_and_base_match_peft_and_single_process(llama):
    base, adapters = llama
    prompts = random_prompts(6, [5, 17, 9], seed=22)
    choice = [None, "a", "b", "a", None, "b"]
    loras = [None if name is None else LoRARequest(name, adapters[name]) for name in choice]
    # One slot for two adapters: a and b take turns in it (each sent to the workers once, its slot
    # re-cut on every rank at each swap).
    with LLM(str(base), max_loras=1, max_lora_rank=8, **CPU) as single:
        expected = _tokens(single.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    with LLM(str(base), max_loras=1, max_lora_rank=8, tensor_parallel_size=2, **CPU) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert _tokens(outputs) == expected
        for prompt, name, out in zip(prompts, choice, outputs):
            assert out.outputs[0].token_ids == peft_greedy(base, adapters.get(name), prompt), name
            assert out.lora_name == name
        assert expected[1] != peft_greedy(base, None, prompts[1]), "adapter a must change the answer"
        assert sorted(llm.list_loras()) == ["a", "b"]  # known by name now
        prompt = prompts[2]
        for name in ("b", "a", "b"):
            [out] = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest(name))
            assert out.outputs[0].token_ids == peft_greedy(base, adapters[name], prompt), name
        assert_pool_whole(llm.stats())


def test_tp2_phi3_adapter_over_fused_qkv_matches_peft(tmp_path):
    config = Phi3Config(**TINY_COMMON, sliding_window=12, partial_rotary_factor=0.75, architectures=["Phi3ForCausalLM"])
    base = save_tiny_model(config, tmp_path / "base", seed=6)
    adapter = make_adapter(base, tmp_path / "adapter", seed=9, target_modules=["qkv_proj", "o_proj", "gate_up_proj",
                                                                              "down_proj"])
    prompts = random_prompts(3, [15, 6], seed=28)
    lora = LoRARequest("phi3", adapter)
    with LLM(str(base), max_loras=1, max_lora_rank=4, tensor_parallel_size=2, **CPU) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[lora, None, lora])
    for prompt, path, out in zip(prompts, [adapter, None, adapter], outputs):
        assert out.outputs[0].token_ids == peft_greedy(base, path, prompt), path
    assert outputs[0].outputs[0].token_ids != peft_greedy(base, None, prompts[0])
