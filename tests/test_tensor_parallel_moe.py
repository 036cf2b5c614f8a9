"""Tensor parallelism of the MoE families on the CPU (two gloo ranks, fp32): each rank keeps its
slice of every expert's intermediate width, and greedy tokens equal HF transformers and the
single-process engine, for Mixtral, Qwen3-MoE and Qwen2-MoE with its shared expert (dense
layers in between), batched, with prefix hits and a preemption.
"""
from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from hearth_llm.engine import LLM
from hearth_llm.engine.memory.weights import weights_bytes
from hearth_llm.engine.models.linear import TensorParallel, configure_linears
from hearth_llm.engine.models.moe import FusedMoE, SparseMoeBlock, shard_experts

from conftest import TINY_COMMON, assert_pool_whole, random_prompts
from model_equality import GREEDY, assert_matches_hf, save_tiny_model

THREE_LAYERS = {**TINY_COMMON, "num_hidden_layers": 3}
QWEN_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
CONFIGS = {
    "mixtral": lambda: MixtralConfig(**{**TINY_COMMON, "intermediate_size": 48}, num_local_experts=4,
                                     num_experts_per_tok=2, architectures=["MixtralForCausalLM"]),
    # layer 1 dense (mlp_only_layers): the dense MLP is split like any other
    "qwen3_moe": lambda: Qwen3MoeConfig(**THREE_LAYERS, **QWEN_EXPERTS, head_dim=16, norm_topk_prob=True,
                                        mlp_only_layers=[1], tie_word_embeddings=False,
                                        architectures=["Qwen3MoeForCausalLM"]),
    # a shared expert behind its sigmoid gate: reduced together with the routed experts
    "qwen2_moe": lambda: Qwen2MoeConfig(**THREE_LAYERS, **QWEN_EXPERTS, shared_expert_intermediate_size=48,
                                        decoder_sparse_step=2, tie_word_embeddings=False,
                                        architectures=["Qwen2MoeForCausalLM"]),
}
CPU = dict(device="cpu", dtype="float32", show_progress=False, block_size=8)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_moe")
    return {name: save_tiny_model(make(), root / name, seed=len(name)) for name, make in CONFIGS.items()}


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_moe_matches_hf_and_single_process(model_dirs, name):
    path = model_dirs[name]
    prompts = random_prompts(4, [3, 30, 11, 1], seed=41)
    prefix = random_prompts(1, [24], seed=42)[0]
    shared = [prefix + suffix for suffix in random_prompts(2, [5, 2], seed=43)]
    with LLM(str(path), **CPU) as single:
        expected, expected_shared = _tokens(single, prompts), _tokens(single, shared)
        single_bytes = weights_bytes(single.engine.runner.model)
    with LLM(str(path), tensor_parallel_size=2, **CPU) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [out.outputs[0].token_ids for out in outputs] == expected
        assert_matches_hf(path, prompts, outputs)
        first = llm.generate(shared[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(shared[1:], GREEDY, use_tqdm=False)
        assert rest[0].num_cached_tokens == 24
        assert [out.outputs[0].token_ids for out in first + rest] == expected_shared
        # each rank holds about half: its slice of every expert, attention and vocabulary
        assert max(llm.engine.runner.rank_weights_bytes) < 0.6 * single_bytes
        assert_pool_whole(llm.stats())


def _block(parallel: TensorParallel, shared: bool) -> SparseMoeBlock:
    block = SparseMoeBlock(16, num_experts=3, top_k=2, intermediate_size=8, renormalize=True,
                           shared_expert_intermediate_size=12 if shared else None, prefix="mlp")
    configure_linears(block, parallel=parallel)  # the shared expert's and the router's linears
    shard_experts(block, parallel)
    return block


@pytest.mark.parametrize("shared", [False, True])
def test_ranks_partial_blocks_sum_to_the_whole_block(shared):
    """Every checkpoint layout (per expert, stacked [E, ...], transformers 5's fused tensors) cut
    per rank; the ranks' outputs before the all-reduce sum to the unsplit block's output."""
    torch.manual_seed(0)
    gate_up, down = torch.randn(3, 16, 16), torch.randn(3, 16, 8)   # [E, 2 I, H], [E, H, I]
    router, x = torch.randn(3, 16), torch.randn(5, 16)
    shared_weights = (torch.randn(12, 16), torch.randn(12, 16), torch.randn(16, 12), torch.randn(1, 16))

    def load(block: SparseMoeBlock, layout: str) -> SparseMoeBlock:
        experts = block.experts
        block.gate.weight.weight_loader(block.gate.weight, router)
        if layout == "fused":
            experts.w13_weight.weight_loader(experts.w13_weight, gate_up)
            experts.w2_weight.weight_loader(experts.w2_weight, down)
        elif layout == "stacked":
            experts.w13_weight.weight_loader(experts.w13_weight, gate_up[:, :8], "gate")
            experts.w13_weight.weight_loader(experts.w13_weight, gate_up[:, 8:], "up")
            experts.w2_weight.weight_loader(experts.w2_weight, down, "down")
        else:
            for e in range(3):
                experts.w13_weight.weight_loader(experts.w13_weight, gate_up[e, :8], "gate", e)
                experts.w13_weight.weight_loader(experts.w13_weight, gate_up[e, 8:], "up", e)
                experts.w2_weight.weight_loader(experts.w2_weight, down[e], "down", e)
        if block.shared_expert is not None:
            mlp = block.shared_expert
            mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, shared_weights[0], 0)
            mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, shared_weights[1], 1)
            mlp.down_proj.weight.weight_loader(mlp.down_proj.weight, shared_weights[2])
            block.shared_expert_gate.weight.weight_loader(block.shared_expert_gate.weight, shared_weights[3])
        return block

    whole = load(_block(TensorParallel(), shared), "per_expert")(x)
    for layout in ("per_expert", "stacked", "fused"):
        parts = []
        for rank in range(2):
            parallel = TensorParallel(rank=rank, size=2, all_reduce=lambda tensor: None)  # the sum is below
            block = load(_block(parallel, shared), layout)
            assert block.experts.w13_weight.shape == (3, 8, 16) and block.experts.w2_weight.shape == (3, 16, 4)
            parts.append(block(x))
        torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


def test_ranks_that_do_not_divide_the_experts_width_are_refused_by_name():
    experts = FusedMoE(num_experts=2, top_k=1, hidden_size=8, intermediate_size=6, renormalize=False, prefix="mlp.x")
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        experts.configure(TensorParallel(rank=0, size=4, all_reduce=lambda tensor: None))
