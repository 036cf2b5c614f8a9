"""Tensor parallelism with LoRA on the CPU (two gloo ranks, fp32): adapters are checked against
the whole model in the driver, sent to the workers once, and each rank keeps its cut (column-
parallel: A whole, B's columns of its rows; row-parallel: A's columns of its input slice, the
shrink summed by the layer's all-reduce). Greedy tokens equal HF + PEFT and the single-process
engine, per request, in mixed batches with the base model, when adapters swap through fewer
slots than adapters, and for Phi-3, whose adapter B spans the fused q/k/v rows.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config

from hearth_llm.engine import LLM, LoRARequest
from hearth_llm.engine.lora.adapter import ShardLoRA
from hearth_llm.engine.models.linear import QKVLinear, RowLinear, TensorParallel
from hearth_llm.engine.models.tp_lora import rank_shards

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


@pytest.mark.parametrize("size", [2, 4])  # 4 ranks over 2 KV heads: each KV head's B columns on two ranks
@pytest.mark.parametrize("fused", [False, True])  # one adapter over q, k and v (Phi-3's qkv_proj) or one per shard
def test_each_ranks_adapter_cut_is_the_cut_of_its_weight_update(size, fused):
    """The oracle is the layer's own weight loader: the update ``b.T @ a`` of the whole layer, loaded as a
    weight, gives each rank's rows and columns; the rank's cut pieces must rebuild exactly that."""
    torch.manual_seed(0)
    rank_of_lora = 3
    layers = {"qkv": lambda: QKVLinear(64, 16, num_heads=4, num_kv_heads=2), "down": lambda: RowLinear(96, 64)}
    for kind, make in layers.items():
        whole = make()
        if kind == "qkv" and fused:
            shard_ids, sizes = [None], [whole.output_size]
        else:
            shard_ids, sizes = whole.shard_ids, whole.output_sizes
        starts = [sum(whole.output_sizes[:whole.shard_ids.index(s)]) if s is not None else 0 for s in shard_ids]
        shards = [ShardLoRA(i, start, torch.randn(rank_of_lora, whole.input_size), torch.randn(rank_of_lora, rows))
                  for i, (start, rows) in enumerate(zip(starts, sizes))]
        for rank in range(size):
            layer = make()
            layer.configure(parallel=TensorParallel(rank=rank, size=size, all_reduce=lambda t: None))
            for shard_id, shard in zip(shard_ids, shards):
                layer.weight.weight_loader(layer.weight, shard.b_scaled.T @ shard.a, shard_id)
            rebuilt = torch.zeros_like(layer.weight)
            for piece in rank_shards(layer, shards):
                rebuilt[piece.row_start:piece.row_start + piece.b_scaled.shape[1]] += piece.b_scaled.T @ piece.a
            torch.testing.assert_close(rebuilt, layer.weight, rtol=1e-5, atol=1e-5)
