"""MoE kernels against the torch reference: routing, the block-aligned layout, the CPU path and the
Triton kernels (under the interpreter on CPU, tiny shapes; full Qwen3-30B-A3B-size cases on CUDA)."""
import pytest
import torch

from hearth_llm.kernels import moe
from hearth_llm.kernels.moe import align, cpu, reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The Triton tests run on CUDA where there is one, else on CPU tensors under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (num_tokens, num_experts, top_k, hidden, intermediate): odd sizes exercise the masks.
TINY_SHAPES = [(5, 4, 2, 64, 32), (33, 8, 3, 48, 40), (1, 16, 4, 32, 16), (70, 6, 1, 32, 24)]


def routed_problem(num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype=torch.float32,
                   device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype=dtype, device=device)

    hidden = rand(num_tokens, hidden_size)
    w13 = rand(num_experts, 2 * intermediate_size, hidden_size, scale=hidden_size ** -0.5)
    w2 = rand(num_experts, hidden_size, intermediate_size, scale=intermediate_size ** -0.5)
    logits = torch.randn(num_tokens, num_experts, generator=generator).to(device)
    weights, ids = reference.select_experts(logits, top_k, renormalize=True)
    return hidden, w13, w2, weights, ids


def triton_moe():
    return pytest.importorskip("hearth_llm.kernels.moe.triton_moe")


# ------------------------------------------------------------------ routing


def test_select_experts_keeps_the_largest_probabilities_in_order():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    weights, ids = reference.select_experts(logits, top_k=2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights, probs[:, [1, 3]])


def test_select_experts_renormalize_makes_weights_sum_to_one():
    weights, _ = reference.select_experts(torch.randn(7, 10), top_k=3, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(7))


@pytest.mark.parametrize("top_k", [0, 5, 2.0, True])
def test_select_experts_refuses_a_top_k_out_of_range(top_k):
    with pytest.raises(ValueError, match="top_k"):
        moe.select_experts(torch.randn(2, 4), top_k=top_k, renormalize=True)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts,top_k", [(4, 2), (10, 3), (128, 8), (6, 1)])
def test_triton_select_experts_matches_reference(num_experts, top_k, renormalize):
    logits = torch.randn(37, num_experts, generator=torch.Generator().manual_seed(num_experts)).to(DEVICE)
    weights, ids = triton_moe().select_experts(logits, top_k, renormalize)
    expected_weights, expected_ids = reference.select_experts(logits, top_k, renormalize)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights)


# ------------------------------------------------------------------ the reference itself


def test_reference_is_the_sum_over_each_tokens_experts():
    hidden, w13, w2, weights, ids = routed_problem(3, 4, 2, 16, 8)
    expected = torch.zeros_like(hidden)
    for token in range(3):
        for slot in range(2):
            gate, up = (w13[ids[token, slot]] @ hidden[token]).chunk(2)
            expected[token] += weights[token, slot] * (w2[ids[token, slot]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(reference.fused_moe(hidden, w13, w2, weights, ids), expected)


@pytest.mark.parametrize("bad", ["w2", "topk_weights", "hidden"])
def test_fused_moe_refuses_mismatched_shapes(bad):
    hidden, w13, w2, weights, ids = routed_problem(3, 4, 2, 16, 8)
    args = dict(hidden=hidden, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    args[bad] = args[bad][..., :-1]
    with pytest.raises(ValueError, match=bad):
        moe.fused_moe(**args)


# ------------------------------------------------------------------ CPU path


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_cpu_path_matches_reference(shape):
    hidden, w13, w2, weights, ids = routed_problem(*shape)
    torch.testing.assert_close(cpu.fused_moe(hidden, w13, w2, weights, ids),
                               reference.fused_moe(hidden, w13, w2, weights, ids))


def test_cpu_path_in_bf16_is_close_to_reference():
    hidden, w13, w2, weights, ids = routed_problem(40, 8, 2, 64, 32, dtype=torch.bfloat16)
    out = cpu.fused_moe(hidden, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference.fused_moe(hidden, w13, w2, weights, ids), atol=3e-2, rtol=3e-2)


def test_dispatch_sends_cpu_tensors_to_the_cpu_path(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "fused_moe", lambda *args: calls.append(args) or args[0])
    hidden, w13, w2, weights, ids = routed_problem(2, 4, 2, 16, 8)
    moe.fused_moe(hidden, w13, w2, weights, ids)
    assert len(calls) == 1


def test_cpu_path_skips_experts_without_tokens():
    hidden, w13, w2, weights, ids = routed_problem(4, 8, 2, 16, 8)
    ids = torch.tensor([[0, 1]] * 4)
    # NaN weights in unused experts would poison the output if they were multiplied at all.
    w13[2:] = float("nan")
    assert not cpu.fused_moe(hidden, w13, w2, weights, ids).isnan().any()


# ------------------------------------------------------------------ layout


def distinct_random_ids(num_tokens, num_experts, top_k, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(num_tokens, num_experts, generator=generator).topk(top_k, -1).indices.to(torch.int32)


def assert_layout_equal_up_to_order_within_experts(layout, expected, block_m):
    sorted_entries, block_experts, num_padded = layout
    expected_entries, expected_experts, expected_padded = expected
    assert num_padded.item() == expected_padded.item()
    num_blocks = expected_padded.item() // block_m
    assert torch.equal(block_experts[:num_blocks].cpu(), expected_experts[:num_blocks])
    # An expert's group: its entries in any order, then the sentinel padding.
    for expert in expected_experts[:num_blocks].unique().tolist():
        blocks = (expected_experts[:num_blocks] == expert).nonzero().flatten()
        group = slice(blocks[0].item() * block_m, (blocks[-1].item() + 1) * block_m)
        num_real = int((expected_entries[group] != expected_entries.max()).sum())
        assert sorted(sorted_entries[group][:num_real].tolist()) == expected_entries[group][:num_real].tolist()
        assert torch.equal(sorted_entries[group][num_real:], expected_entries[group][num_real:]), f"expert {expert}"


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [
    (3, 4, 2, 16), (1, 128, 8, 16), (50, 10, 3, 16), (40, 8, 2, 64),
    (700, 16, 8, 32),  # 5600 entries: the three-kernel path
])
def test_align_groups_entries_by_expert_in_padded_blocks(num_tokens, num_experts, top_k, block_m):
    triton_moe()
    ids = distinct_random_ids(num_tokens, num_experts, top_k)
    layout = align.align_block_size(ids.to(DEVICE), num_experts, block_m)
    # The reference keeps batch order within an expert, the kernels any order.
    expected = align.align_reference(ids, num_experts, block_m)
    assert_layout_equal_up_to_order_within_experts([part.cpu() for part in layout], expected, block_m)


def test_align_reference_pads_each_group_with_the_sentinel():
    ids = torch.tensor([[0, 1], [1, 3], [3, 0]])
    sorted_entries, block_experts, num_padded = align.align_reference(ids, 4, block_m=16)
    assert num_padded.item() == 48  # experts 0, 1, 3 each take one block; expert 2 none
    assert block_experts[:3].tolist() == [0, 1, 3]
    assert sorted_entries[:16].tolist() == [0, 5] + [6] * 14


# ------------------------------------------------------------------ Triton under the interpreter


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_triton_fused_moe_matches_reference(shape):
    hidden, w13, w2, weights, ids = routed_problem(*shape, device=DEVICE)
    out = triton_moe().fused_moe(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out, reference.fused_moe(hidden, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_triton_fused_moe_matches_reference_for_each_block_m(block_m):
    module = triton_moe()
    hidden, w13, w2, weights, ids = routed_problem(21, 5, 2, 32, 32, device=DEVICE)
    gemm = module.GemmConfig(block_n=32, block_k=16, num_warps=4, num_stages=2)
    out = module.fused_moe(hidden, w13, w2, weights, ids, config=module.MoeConfig(block_m, gemm, gemm))
    torch.testing.assert_close(out, reference.fused_moe(hidden, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_triton_fused_moe_with_no_tokens_is_empty():
    hidden, w13, w2, weights, ids = routed_problem(0, 4, 2, 16, 8, device=DEVICE)
    assert triton_moe().fused_moe(hidden, w13, w2, weights, ids).shape == (0, 16)


def test_launch_configs_cover_every_batch_size():
    module = triton_moe()
    sizes = [1, 16, 17, 255, 256, 1000, 16384, 10**9]
    assert all(module.config_for(size).block_m in (16, 32, 64, 128) for size in sizes)


# ------------------------------------------------------------------ CUDA, full size


QWEN3_30B_EXPERTS = dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 1000, 5000])
def test_cuda_fused_moe_matches_cpu_path_on_the_qwen3_30b_expert_shape(num_tokens):
    shape = QWEN3_30B_EXPERTS
    hidden, w13, w2, weights, ids = routed_problem(num_tokens, shape["num_experts"], shape["top_k"],
                                                   shape["hidden_size"], shape["intermediate_size"],
                                                   dtype=torch.bfloat16, device="cuda")
    out = moe.fused_moe(hidden, w13, w2, weights, ids)
    # The sort-by-expert path on the GPU, fp32 throughout, is the reference at this size.
    expected = cpu.fused_moe(hidden.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_cuda
def test_cuda_fused_moe_fp32_is_exact_to_reference():
    hidden, w13, w2, weights, ids = routed_problem(9, 16, 4, 256, 128, device="cuda")
    torch.testing.assert_close(moe.fused_moe(hidden, w13, w2, weights, ids),
                               reference.fused_moe(hidden, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@needs_cuda
def test_cuda_select_experts_matches_reference():
    logits = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe.select_experts(logits, 8, True)
    expected_weights, expected_ids = reference.select_experts(logits, 8, True)
    # bf16 logits tie often; tied experts may be picked in either order, with equal weights.
    torch.testing.assert_close(weights, expected_weights)
    picked_logits = logits.float().gather(1, ids.long())
    torch.testing.assert_close(picked_logits, logits.float().gather(1, expected_ids), atol=0, rtol=0)


@needs_cuda
def test_cuda_fused_moe_replays_in_a_cuda_graph():
    hidden, w13, w2, weights, ids = routed_problem(16, 128, 8, 256, 128, dtype=torch.bfloat16, device="cuda")
    moe.fused_moe(hidden, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(hidden, w13, w2, weights, ids)
    new_hidden, _, _, new_weights, new_ids = routed_problem(16, 128, 8, 256, 128, dtype=torch.bfloat16,
                                                            device="cuda", seed=1)
    hidden.copy_(new_hidden), weights.copy_(new_weights), ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out.float(), reference.fused_moe(hidden, w13, w2, weights, ids).float(),
                               atol=2e-2, rtol=2e-2)


def test_launch_configs_fit_shared_memory_for_fp32_and_keep_bf16_as_tuned():
    from hearth_llm.kernels.moe import triton_moe

    for _, config in triton_moe.CONFIGS:
        for gemm, gated in ((config.up, True), (config.down, False)):
            # bf16: the tuned table launches as measured
            assert triton_moe.fit_shared_memory(gemm, config.block_m, 2, gated) == gemm
            fitted = triton_moe.fit_shared_memory(gemm, config.block_m, 4, gated)
            assert triton_moe.shared_memory_bytes(fitted, config.block_m, 4, gated) <= triton_moe.SHARED_MEMORY_BYTES
            assert fitted.block_n == gemm.block_n and gemm.block_k % fitted.block_k == 0
    decode = triton_moe.CONFIGS[0][1]
    # the launch that failed on the H200 for Mixtral in fp32 (294,912 bytes)
    assert triton_moe.shared_memory_bytes(decode.up, decode.block_m, 4, True) == 294_912
