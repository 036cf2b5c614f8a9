"""Batched LoRA kernels: the torch reference against the per-token definition, the Triton kernel
(under the interpreter on CPU, natively on CUDA) against the reference, and the CPU layer path
that keeps only a step's slots."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hearth_llm.engine.lora.adapter import ShardLoRA
from hearth_llm.engine.models.linear import QKVLinear
from hearth_llm.engine.models.lora_linear import LoRAStep, LoRALinearMethod
from hearth_llm.kernels.lora import LoRAPlan, reference, scratch_numel
from hearth_llm.kernels.lora.plan import block_m_for, max_tiles_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(num_tokens, in_features, out_features, num_slots, rank, seed=0, dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=generator).to(device)
    return rand(num_tokens, out_features), rand(num_tokens, in_features), slots, rand(num_slots, rank, in_features), \
        rand(num_slots, rank, out_features)


@pytest.mark.parametrize("shape", [(7, 20, 33, 3, 5), (1, 8, 8, 1, 1), (40, 64, 96, 4, 16)])
def test_reference_matches_the_per_token_definition(shape):
    y, x, slots, a, b = _inputs(*shape)
    expected = reference.add_lora_per_token(y.clone(), x, slots, a, b)
    torch.testing.assert_close(reference.add_lora(y.clone(), x, slots, a, b), expected, rtol=1e-5, atol=1e-4)


def test_base_tokens_are_left_bit_identical():
    y, x, slots, a, b = _inputs(9, 16, 24, 2, 4, seed=1)
    slots[::2] = -1
    out = reference.add_lora(y.clone(), x, slots, a, b)
    assert torch.equal(out[::2], y[::2])
    assert not torch.equal(out[1::2], y[1::2])


@pytest.mark.parametrize("shape", [(5, 20, 33, 3, 6), (3, 130, 70, 2, 48), (2, 16, 16, 1, 1),
                                   (150, 40, 72, 3, 5), (200, 24, 20, 5, 20),  # > 128 tokens: the sorted blocks
                                   (4, 16, 24, 2, 150), (140, 16, 24, 2, 150),  # ranks in several chunks
                                   (1100, 24, 200, 3, 6)])  # prefill-sized tiles: no K split, a column block each
def test_triton_matches_reference(shape):
    triton_lora = pytest.importorskip("hearth_llm.kernels.lora.triton_lora")
    y, x, slots, a, b = _inputs(*shape, seed=2, device=DEVICE)
    slots[0] = -1
    expected = reference.add_lora(y.clone(), x, slots, a, b)
    out = triton_lora.add_lora(y.clone(), x, slots, a, b)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(out[0], y[0])  # a base token is not even rounded


def _sequences(seed, num_seqs, num_slots, longest):
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, num_slots, (num_seqs,), generator=generator).numpy()
    counts = torch.randint(0, longest + 1, (num_seqs,), generator=generator).numpy()
    return slots, counts


@pytest.mark.parametrize("seed, num_seqs, longest", [(0, 9, 3), (1, 40, 1), (2, 6, 300), (3, 30, 90)])
def test_plan_puts_every_adapter_token_in_one_tile_of_its_slot(seed, num_seqs, longest):
    slots, counts = _sequences(seed, num_seqs, 4, longest)
    plan = LoRAPlan(capacity=int(counts.sum()) + 1, num_slots=4, device=torch.device("cpu"))
    plan.set_sequences(slots, counts)
    token_slots = torch.from_numpy(np.repeat(slots, counts))
    assert plan.has_adapters == bool((token_slots >= 0).any())
    assert torch.equal(reference.token_slots_of(plan, len(token_slots)), token_slots)
    tiles = plan.tiles[plan.tiles[:, 0] >= 0]
    assert len(tiles) <= max_tiles_for(len(token_slots), 4)
    assert (tiles[:, 2] >= 1).all() and (tiles[:, 2] <= block_m_for(len(token_slots))).all()
    positions = torch.cat([torch.arange(int(start), int(start + count)) for _, start, count in tiles.tolist()])
    assert sorted(positions.tolist()) == list(range(int((token_slots >= 0).sum())))  # each token exactly once


def test_plan_of_a_base_only_step_has_no_adapters():
    plan = LoRAPlan(capacity=16, num_slots=2, device=torch.device("cpu"))
    plan.set_sequences([0], [3])
    plan.set_sequences([-1, -1], [5, 1])
    assert not plan.has_adapters and plan.num_tokens == 6


def test_plan_tile_size_is_the_same_for_a_step_and_its_padded_graph():
    """A graph captured at a padded row count launches with that count's tile size and grid; the
    plan of the real step must agree, or the graph would read its tiles wrongly."""
    from hearth_llm.engine.cuda_graphs import capture_sizes

    sizes = capture_sizes(512)
    for num_tokens in range(1, 513):
        padded = next(size for size in sizes if size >= num_tokens)
        assert block_m_for(num_tokens) == block_m_for(padded), num_tokens
        assert max_tiles_for(num_tokens, 8) <= max_tiles_for(padded, 8)


def _fused_inputs(seed, num_tokens, in_features, slice_sizes, num_slots, rank):
    """Slot tensors of a fused layer: a rank block per slice, B zero outside its slice's columns."""
    generator = torch.Generator().manual_seed(seed)
    out_features = sum(slice_sizes)
    a = torch.randn(num_slots, len(slice_sizes) * rank, in_features, generator=generator)
    b = torch.zeros(num_slots, len(slice_sizes) * rank, out_features)
    bounds = np.cumsum([0] + list(slice_sizes))
    for piece, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        b[:, piece * rank:(piece + 1) * rank, start:end] = torch.randn(num_slots, rank, end - start, generator=generator)
    x = torch.randn(num_tokens, in_features, generator=generator)
    y = torch.randn(num_tokens, out_features, generator=generator)
    return y, x, a, b, torch.tensor(bounds, dtype=torch.int32)


@pytest.mark.parametrize("slice_sizes", [[64, 64, 128], [70, 30, 60], [96, 96]])
@pytest.mark.parametrize("num_tokens, in_features, expand_programs", [
    (3, 1024, 528),   # split K, a column block per program
    (140, 48, 1),     # several tiles per slot; each program loops over every column block
])
def test_triton_planned_fused_slices_match_reference(slice_sizes, num_tokens, in_features, expand_programs,
                                                     monkeypatch):
    triton_lora = pytest.importorskip("hearth_llm.kernels.lora.triton_lora")
    monkeypatch.setattr(triton_lora, "_TARGET_EXPAND_PROGRAMS", expand_programs)
    y, x, a, b, bounds = _fused_inputs(6, num_tokens, in_features, slice_sizes, 3, 4)
    slots, counts = np.array([2, -1, 0, 2]), np.array([num_tokens - num_tokens // 2 - 1, 1, num_tokens // 2, 0])
    plan = LoRAPlan(capacity=num_tokens, num_slots=3, device=torch.device("cpu"))
    plan.set_sequences(slots, counts)
    scratch = torch.zeros(scratch_numel(num_tokens, a.shape[1]), device=DEVICE)
    splits = triton_lora.num_splits_for(num_tokens, in_features, a.shape[1], 3, 16384)
    assert (splits > 1) == (num_tokens == 3)
    to = lambda t: t.to(DEVICE)
    out = triton_lora.add_lora_planned(to(y.clone()), to(x), _on(plan, DEVICE), to(a), to(b), to(bounds), 4,
                                       scratch).cpu()
    token_slots = torch.from_numpy(np.repeat(slots, counts))
    torch.testing.assert_close(out, reference.add_lora(y.clone(), x, token_slots, a, b), rtol=1e-4, atol=1e-3)
    base_row = int(counts[0])
    assert torch.equal(out[base_row], y[base_row])  # the base token is not even rounded
    assert not scratch[-triton_lora.NUM_TICKETS:].view(torch.int32).any()  # the split tickets are back at zero
    again = triton_lora.add_lora_planned(to(y.clone()), to(x), _on(plan, DEVICE), to(a), to(b), to(bounds), 4,
                                         scratch).cpu()
    assert torch.equal(again, out)  # the split sums run in a fixed order


@pytest.mark.parametrize("num_tokens, intermediate_size, expand_programs", [
    (5, 96, 528),     # decode-sized tiles, a column block per program, base tokens between adapter tokens
    (140, 80, 1),     # several tiles per slot; each program loops over every column block (a partial one)
    (1100, 40, 528),  # prefill-sized tiles
])
@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_expand_silu_and_mul_is_the_expand_then_the_activation(kernel, num_tokens, intermediate_size,
                                                               expand_programs, monkeypatch):
    """A gated MLP's SwiGLU with the gate_up update added on the way in equals the in-place expand followed
    by silu_and_mul, reading the update from the stacked GEMM's columns of every slot; base rows (the plan's
    base tiles) are the activation of the projection alone, bit for bit."""
    from hearth_llm.kernels import lora
    from hearth_llm.kernels.activation import reference as activation_reference

    if kernel == "triton":
        triton_lora = pytest.importorskip("hearth_llm.kernels.lora.triton_lora")
        monkeypatch.setattr(triton_lora, "_TARGET_EXPAND_PROGRAMS", expand_programs)
        fused = triton_lora.expand_silu_and_mul_planned
        device = DEVICE
    else:
        fused, device = lora.expand_silu_and_mul_planned, "cpu"
    num_slots, rank = 3, 4
    y, x, a, b, _ = _fused_inputs(8, num_tokens, 24, [intermediate_size] * 2, num_slots, rank)
    slot_stride = a.shape[1]
    shrunk_all = x @ a.reshape(-1, 24).T  # [T, S * 2R]: every slot's rank-space row, as the stacked GEMM gives
    full = torch.cat([y, shrunk_all], dim=1)  # the GEMM's output: base columns, then every slot's ranks
    slots = np.array([1, -1, 0, -1, 2, 1])
    counts = np.array([num_tokens // 3, 1, num_tokens // 4, num_tokens - num_tokens // 3 - num_tokens // 4 - 3, 1, 1])
    plan = LoRAPlan(capacity=num_tokens, num_slots=num_slots, device=torch.device("cpu"))
    plan.set_sequences(slots, counts)
    token_slots = torch.from_numpy(np.repeat(slots, counts))
    full = full.to(device)
    out = fused(full[:, :2 * intermediate_size], full[:, 2 * intermediate_size:], _on(plan, device), b.to(device),
                rank, slot_stride).cpu()
    expanded = reference.add_lora(y.clone(), x, token_slots, a, b)
    torch.testing.assert_close(out, activation_reference.silu_and_mul(expanded), rtol=1e-4, atol=1e-4)
    is_base = token_slots < 0
    if kernel == "triton":  # the Triton silu_and_mul: what base-only steps run on CUDA
        plain = pytest.importorskip("hearth_llm.kernels.activation.triton_activation").silu_and_mul(y.to(device))
    else:
        plain = activation_reference.silu_and_mul(y)
    assert torch.equal(out[is_base], plain.cpu()[is_base])


def _on(plan, device):
    """The same plan with its buffers on ``device``."""
    if plan.device.type == device:
        return plan
    moved = LoRAPlan(plan.capacity, plan.num_slots, torch.device(device))
    moved.buffer.copy_(plan.buffer)
    moved.num_tokens, moved.block_m, moved.has_adapters = plan.num_tokens, plan.block_m, plan.has_adapters
    return moved


def test_planned_layer_path_splits_a_whole_layer_shard_across_its_slices(monkeypatch):
    """Phi-3's pre-fused qkv_proj adapters span q, k and v: the slot keeps each slice's columns in
    that slice's rank block, which the expand relies on (it skips the blocks of other slices)."""
    from hearth_llm.engine.models import lora_linear
    triton_lora = pytest.importorskip("hearth_llm.kernels.lora.triton_lora")

    monkeypatch.setattr(lora_linear, "add_lora_planned", triton_lora.add_lora_planned)  # (on the CPU too)
    device = torch.device(DEVICE)
    layer = QKVLinear(hidden_size=16, head_dim=16, num_heads=4, num_kv_heads=2, bias=False)  # q 64, k 32, v 32
    torch.nn.init.normal_(layer.weight)
    layer.to(device)
    step = LoRAStep(capacity=32, device=device, planned=True)
    step.allocate(num_slots=2, max_ranks_per_layer=3 * 4)
    method = LoRALinearMethod(layer.method, layer, num_slots=2, max_rank=4, step=step, dtype=torch.float32,
                              device=device)
    layer.method = method
    generator = torch.Generator().manual_seed(7)
    whole_a, whole_b = torch.randn(3, 16, generator=generator), torch.randn(3, 128, generator=generator)
    q_a, q_b = torch.randn(4, 16, generator=generator), torch.randn(4, 64, generator=generator)
    method.load_slot(0, [ShardLoRA(0, 0, whole_a, whole_b)])
    method.load_slot(1, [ShardLoRA(0, 0, q_a, q_b)])
    x = torch.randn(7, 16, generator=generator).to(device)
    base = torch.nn.functional.linear(x, layer.weight)
    step.begin_sequences([0, -1, 1], [3, 2, 2])
    out = layer(x)
    step.end()
    expected = base.clone().cpu()
    x, out, base = x.cpu(), out.cpu(), base.cpu()
    expected[:3] += (x[:3] @ whole_a.T) @ whole_b
    expected[5:, :64] += (x[5:] @ q_a.T) @ q_b
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)
    assert torch.equal(out[3:5], base[3:5])
    assert torch.equal(layer(x.to(device)).cpu(), base)  # after end(): nothing added


BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bf16 keeps 8 significant bits: round-to-nearest is off by <= 2^-8 |value|


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton on CUDA")
@pytest.mark.parametrize("num_tokens", [64, 300])  # decode-sized tiles with split K, prefill-sized tiles
def test_triton_bf16_is_close_to_fp32_reference(num_tokens):
    """Error model, for x, A, B, y ~ N(0, 1), K = 4096, R = 48: delta = (x A^T) B has RMS sqrt(K R) ~ 443
    (the shrink alone ~ sqrt(K) = 64), so bf16's relative 2^-8 is an absolute error of ~1.7 on most outputs:
    no fixed atol fits it, and a small output next to a large one carries the same absolute error.

    1. The kernel's own arithmetic, against exact (float32) math on the same bf16 inputs: it may only round
       the output once (round-to-nearest: <= 2^-8 |ref|) and the float32 shrink result to bf16 before the
       tensor-core dot (<= 2^-8 (|s| @ |B|) per element); float32 accumulation
       order adds ~1e-3 (atol 0.05). Accumulating in bf16 breaks this bound by 2-140x.
    2. End to end, against float32 math on the float32 inputs: rounding x, A, B (and y) to bf16 adds
       independent relative errors of RMS ~0.425 * 2^-8 each, which propagate to an RMS error of
       ~0.85 * 2^-8 * rms(delta) with the output rounding (0.95 with the intermediate's); allow 1.25x, and a
       largest error of 8x (seen: 4x of 55k outputs, 6.2x of 275k, in a float32 emulation of the kernel).
    """
    from hearth_llm.kernels.lora import triton_lora

    y, x, slots, a, b = _inputs(num_tokens, 4096, 1024, 8, 48, seed=3, dtype=torch.float32, device="cuda")
    expected = reference.add_lora(y.clone(), x, slots, a, b)
    y16, x16, a16, b16 = y.bfloat16(), x.bfloat16(), a.bfloat16(), b.bfloat16()
    out = triton_lora.add_lora(y16.clone(), x16, slots, a16, b16).float()
    has_adapter = slots >= 0
    assert torch.equal(out[~has_adapter], y16[~has_adapter].float())

    same_inputs = reference.add_lora(y16.float(), x16.float(), slots, a16.float(), b16.float())
    bound = BF16_UNIT_ROUNDOFF * same_inputs.abs() + 0.05
    own = slots.clamp(min=0)  # the rank-space intermediate goes to bf16 for the tensor-core dot
    shrunk = torch.bmm(a16.float()[own], x16.float().unsqueeze(-1)).squeeze(-1)
    bound += BF16_UNIT_ROUNDOFF * torch.bmm(shrunk.abs().unsqueeze(1), b16.float()[own].abs()).squeeze(1)
    ratio = ((out - same_inputs).abs() / bound)[has_adapter]
    assert ratio.max().item() <= 1.0, f"kernel error {ratio.max().item():.2f}x its rounding bound"

    scale = BF16_UNIT_ROUNDOFF * (expected - y)[has_adapter].pow(2).mean().sqrt()
    error = (out - expected)[has_adapter]
    rms, largest = error.pow(2).mean().sqrt() / scale, error.abs().max() / scale
    assert rms.item() <= 1.25 and largest.item() <= 8.0, f"end to end: rms {rms.item():.2f}, max {largest.item():.2f}"


def test_cpu_layer_path_uses_only_the_steps_slots_and_matches_the_full_reference():
    layer = QKVLinear(hidden_size=16, head_dim=4, num_heads=4, num_kv_heads=2, bias=False)
    torch.nn.init.normal_(layer.weight)
    step = LoRAStep(capacity=64, device=torch.device("cpu"))
    method = LoRALinearMethod(layer.method, layer, num_slots=4, max_rank=2, step=step, dtype=torch.float32,
                              device=torch.device("cpu"))
    layer.method = method
    generator = torch.Generator().manual_seed(4)
    for slot in range(4):  # q and v of each slot; k left without an adapter
        method.load_slot(slot, [ShardLoRA(0, 0, torch.randn(2, 16, generator=generator), torch.randn(2, 16, generator=generator)),
                                ShardLoRA(2, 24, torch.randn(1, 16, generator=generator), torch.randn(1, 8, generator=generator))])
    x = torch.randn(6, 16, generator=generator)
    slots = torch.tensor([3, -1, 1, 3, 1, -1])  # slots 1 and 3: not consecutive, an index not a slice
    base = torch.nn.functional.linear(x, layer.weight)
    step.begin(slots)
    out = layer(x)
    step.end()
    assert isinstance(step.used_slots, torch.Tensor) and step.used_slots.tolist() == [1, 3]
    expected = reference.add_lora_per_token(base.clone(), x, slots, method.lora_a, method.lora_b)
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[:, 16:24], base[:, 16:24])  # k rows: no adapter touches them
    assert torch.equal(layer(x), base)  # after end(): a forward nobody prepared runs the base model


def test_cpu_layer_path_on_a_bf16_layer_adds_a_float32_update():
    layer = QKVLinear(hidden_size=16, head_dim=4, num_heads=4, num_kv_heads=2, bias=False).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    step = LoRAStep(capacity=8, device=torch.device("cpu"))
    method = LoRALinearMethod(layer.method, layer, num_slots=2, max_rank=2, step=step, dtype=torch.float32,
                              device=torch.device("cpu"))
    layer.method = method
    generator = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 16, generator=generator), torch.randn(2, 32, generator=generator)
    method.load_slot(1, [ShardLoRA(0, 0, a, b)])
    x = torch.randn(3, 16, generator=generator).bfloat16()
    step.begin(torch.tensor([1, 1, 1]))  # one adapter for every token: the two-matmul path
    out = layer(x)
    step.end()
    assert step.is_single_adapter and out.dtype == torch.bfloat16
    expected = torch.nn.functional.linear(x, layer.weight).float()
    expected[:, :32] += (x.float() @ a.T) @ b
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=0.1)


_COMPILE_FOR_HOPPER = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hearth_llm.kernels.lora import triton_lora as k

shared = {}
for dtype in ("*fp32", "*bf16"):
    fp32 = dtype == "*fp32"
    for block_m, one_block in ((16, True), (64, False)):  # decode-sized and prefill-sized tiles; rank chunks
        cases = [
            (k._shrink_kernel, {"x_ptr": dtype, "a_ptr": dtype, "tiles_ptr": "*i32", "tokens_ptr": "*i32",
                                "sum_ptr": "*fp32", "part_ptr": "*fp32", "tickets_ptr": "*i32"},
             ["K", "R", "K_PER_SPLIT", "stride_xt", "stride_as", "stride_ar", "stride_ps", "stride_pt"],
             {"NUM_SPLITS": 32 if one_block else 1, "BLOCK_M": block_m, "BLOCK_R": 64,
              "BLOCK_K": 32 if fp32 else 64, "DOT_IN_FP32": fp32}),
            (k._expand_kernel, {"part_ptr": "*fp32", "b_ptr": dtype, "tiles_ptr": "*i32", "tokens_ptr": "*i32",
                                "y_ptr": dtype, "slice_starts_ptr": "*i32"},
             ["N", "R", "stride_ps", "stride_pt", "stride_pslot", "stride_bs", "stride_br", "stride_yt"],
             {"NUM_SPLITS": 32 if one_block else 1, "SLICE_RANK": 64, "BLOCK_M": block_m, "BLOCK_R": 256 if one_block else 64,
              "BLOCK_N": 64 if fp32 else 128, "ONE_RANK_BLOCK": one_block, "DOT_IN_FP32": fp32,
              "ONE_TOKEN": one_block, "USE_PDL": one_block}),
            (k._expand_silu_and_mul_kernel, {"y_ptr": dtype, "shrunk_ptr": dtype, "b_ptr": dtype, "tiles_ptr": "*i32",
                                             "tokens_ptr": "*i32", "out_ptr": dtype},
             ["I", "stride_yt", "stride_st", "stride_pslot", "stride_bs", "stride_br", "stride_ot"],
             {"RANK": 64, "BLOCK_M": block_m, "BLOCK_R": 64, "BLOCK_N": 64 if fp32 else 128, "DOT_IN_FP32": fp32,
              "ONE_TOKEN": one_block, "USE_PDL": one_block}),
        ]
        for kernel, pointers, ints, blocks in cases:
            sig = {**pointers, **{name: "i32" for name in ints}, **{name: "constexpr" for name in blocks}}
            compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=blocks),
                                      target=GPUTarget("cuda", 90, 32))
            shared[f"{kernel.__name__}/{dtype}/{block_m}"] = compiled.metadata.shared
print(json.dumps(shared))
"""


def test_triton_kernels_compile_for_hopper_within_its_shared_memory():
    """The interpreter runs the kernels as Python; this compiles them for sm_90 (no GPU needed), so
    what only the compiler refuses (a construct, a launch that needs more shared memory) shows here."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("no ptxas in this triton install")
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(shared) == 12 and max(shared.values()) <= 232448, shared  # the H200's 227 KiB per block


@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_stacked_shrink_layer_path_matches_the_separate_update(kernel, monkeypatch):
    """A dense layer with every slot's A stacked under its weight: one GEMM gives the base output and
    each slot's rank-space rows, the expand (reading each token's own slot's columns) adds the update;
    with a bias, base tokens get the base projection, and a forward the step did not plan gets the base."""
    from hearth_llm.engine.models import lora_linear
    if kernel == "triton":
        triton_lora = pytest.importorskip("hearth_llm.kernels.lora.triton_lora")
        monkeypatch.setattr(lora_linear, "expand_planned", triton_lora.expand_planned)  # (on the CPU too)
    device = torch.device(DEVICE)
    layer = QKVLinear(hidden_size=16, head_dim=16, num_heads=4, num_kv_heads=2, bias=True)  # q 64, k 32, v 32
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(128, 16, generator=generator))
        layer.bias.copy_(torch.randn(128, generator=generator))
    layer.to(device)
    step = LoRAStep(capacity=32, device=device, planned=True)
    step.allocate(num_slots=3, max_ranks_per_layer=3 * 4)
    method = LoRALinearMethod(layer.method, layer, num_slots=3, max_rank=4, step=step, dtype=torch.float32,
                              device=device)
    assert method.stack_a_under_weight(layer)
    layer.method = method
    shards = {slot: [ShardLoRA(block, row_start, torch.randn(rank, 16, generator=generator),
                               torch.randn(rank, size, generator=generator))
                     for block, row_start, size in ((0, 0, 64), (2, 96, 32))] for slot, rank in ((0, 4), (2, 3))}
    for slot, slot_shards in shards.items():
        method.load_slot(slot, slot_shards)
    assert torch.equal(method.stacked_weight[128 + 2 * 12:128 + 2 * 12 + 3], shards[2][0].a.to(device))
    x = torch.randn(9, 16, generator=generator).to(device)
    base = torch.nn.functional.linear(x, layer.weight, layer.bias).cpu()
    slot_of_seq, counts = [2, -1, 0, 2], [3, 2, 3, 1]
    step.begin_sequences(slot_of_seq, counts)
    out = layer(x).cpu()
    step.end()
    assert out.stride(0) == 128 + 3 * 12  # a view of the GEMM's base columns
    expected = base.clone()
    x = x.cpu()
    for row, slot in enumerate(np.repeat(slot_of_seq, counts)):
        for shard, (start, end) in zip(shards.get(slot, ()), ((0, 64), (96, 128))):
            expected[row, start:end] += (x[row] @ shard.a.T) @ shard.b_scaled
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(out[3:5], base[3:5], rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x.to(device)).cpu(), base)  # after end(): the weight alone


def test_stacked_weight_moves_with_the_model_as_one_storage():
    """Sleep moves a model's tensors storage by storage (engine/memory/weights.py): the stacked weight is a
    module attribute, so the layer's weight and the slots' A stay views of one moved copy."""
    from hearth_llm.engine.memory.weights import offload_weights

    layer = QKVLinear(hidden_size=16, head_dim=16, num_heads=4, num_kv_heads=2, bias=False)
    torch.nn.init.normal_(layer.weight)
    step = LoRAStep(capacity=8, device=torch.device("cpu"), planned=True)
    step.allocate(num_slots=2, max_ranks_per_layer=12)
    method = LoRALinearMethod(layer.method, layer, num_slots=2, max_rank=4, step=step, dtype=torch.float32,
                              device=torch.device("cpu"))
    assert method.stack_a_under_weight(layer)
    layer.method = method
    method.load_slot(1, [ShardLoRA(0, 0, torch.ones(4, 16), torch.ones(4, 64))])
    weight = layer.weight.detach().clone()
    offload_weights(layer, pin_memory=False).restore(torch.device("cpu"))
    # (no check that the address changed: the allocator may hand the same address back after the two copies)
    assert method.stacked_weight.data_ptr() == layer.weight.data_ptr()
    assert method.lora_a.untyped_storage().data_ptr() == layer.weight.untyped_storage().data_ptr()
    assert torch.equal(layer.weight, weight) and torch.equal(method.lora_a[1, :4], torch.ones(4, 16))


def test_one_row_stacked_matmul_takes_the_batch1_gemv(monkeypatch):
    """A one-row LoRA step multiplies the stacked weight by the Triton GEMV the base model's fused decode uses
    (cuBLAS is slow at one row), more rows by F.linear; both give the same numbers."""
    from hearth_llm.engine.models import fused_decode, lora_linear

    gemv = pytest.importorskip("hearth_llm.kernels.gemv.triton_gemv")
    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", frozenset({DEVICE}))
    calls = []
    linear = gemv.linear
    monkeypatch.setattr(gemv, "linear", lambda *args: calls.append(args[0].shape[0]) or linear(*args))
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 32, generator=generator).to(DEVICE)
    x = torch.randn(3, 32, generator=generator).to(DEVICE)
    one = lora_linear._stacked_matmul(x[:1], weight, None)
    torch.testing.assert_close(one, torch.nn.functional.linear(x[:1], weight), rtol=1e-5, atol=1e-5)
    assert calls == [1]
    torch.testing.assert_close(lora_linear._stacked_matmul(x, weight, None), torch.nn.functional.linear(x, weight))
    assert calls == [1]


def test_gated_mlp_swiglu_adds_gate_up_update_and_a_broken_forward_leaves_nothing_pending():
    """wrap_with_lora gives a gated MLP whose gate_up_proj has A stacked under its weight a SwiGLU that adds
    the projection's update (the projection leaves it pending); the MLP's output is the per-token definition,
    and a forward that stopped between the two (an exception) leaves nothing for the next step."""
    from hearth_llm.engine.models.lora_linear import LoRASiluAndMul, wrap_with_lora
    from hearth_llm.engine.models.mlp import GatedMLP

    torch.manual_seed(4)
    mlp = GatedMLP(hidden_size=16, intermediate_size=24)
    with torch.no_grad():
        for layer in (mlp.gate_up_proj, mlp.down_proj):
            layer.weight.normal_()
    step = LoRAStep(capacity=8, device=torch.device("cpu"), planned=True)
    methods = wrap_with_lora(mlp, num_slots=2, max_rank=4, step=step)
    gate_up, down = methods["gate_up_proj"], methods["down_proj"]
    assert isinstance(mlp.act_and_mul, LoRASiluAndMul) and gate_up.defers_expand and not down.defers_expand
    shards = {"gate_up_proj": [ShardLoRA(0, 0, torch.randn(3, 16), torch.randn(3, 24)),
                               ShardLoRA(1, 24, torch.randn(2, 16), torch.randn(2, 24))],
              "down_proj": [ShardLoRA(0, 0, torch.randn(4, 24), torch.randn(4, 16))]}
    for name, method in methods.items():
        method.load_slot(1, shards[name])
    x = torch.randn(5, 16)
    step.begin_sequences([1, -1], [3, 2])
    mlp.gate_up_proj(x)  # a forward that stops here
    assert gate_up.pending_expand is not None
    step.begin_sequences([1, -1], [3, 2])
    assert gate_up.pending_expand is None
    out = mlp(x)
    step.end()
    w_gate_up, w_down = mlp.gate_up_proj.weight.detach(), mlp.down_proj.weight.detach()
    expected = torch.empty(5, 16)
    for row in range(5):
        g_u = x[row] @ w_gate_up.T
        if row < 3:
            g_u[:24] += (x[row] @ shards["gate_up_proj"][0].a.T) @ shards["gate_up_proj"][0].b_scaled
            g_u[24:] += (x[row] @ shards["gate_up_proj"][1].a.T) @ shards["gate_up_proj"][1].b_scaled
        act = torch.nn.functional.silu(g_u[:24]) * g_u[24:]
        expected[row] = act @ w_down.T
        if row < 3:
            expected[row] += (act @ shards["down_proj"][0].a.T) @ shards["down_proj"][0].b_scaled
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("slot", [0, 2])
def test_one_token_steps_match_the_reference(slot):
    """A one-token step (batch-1 decode) takes the kernels' one-token variant (the slot is the only load
    before the data's): expand and the LoRA SwiGLU equal the reference. (A step whose one token is a base
    token has no adapter: the LoRA path does not run.)"""
    triton_lora = pytest.importorskip("hearth_llm.kernels.lora.triton_lora")
    from hearth_llm.kernels.activation import reference as activation_reference

    y, x, a, b, bounds = _fused_inputs(9, 1, 24, [40, 40], 3, 4)
    plan = LoRAPlan(capacity=1, num_slots=3, device=torch.device("cpu"))
    plan.set_sequences([slot], [1])
    token_slots = torch.tensor([slot])
    expected = reference.add_lora(y.clone(), x, token_slots, a, b)
    shrunk_all = x @ a.reshape(-1, 24).T
    full = torch.cat([y, shrunk_all], dim=1).to(DEVICE)
    device_plan = _on(plan, DEVICE)
    out = triton_lora.expand_silu_and_mul_planned(full[:, :80], full[:, 80:], device_plan, b.to(DEVICE), 4,
                                                  a.shape[1]).cpu()
    torch.testing.assert_close(out, activation_reference.silu_and_mul(expected), rtol=1e-4, atol=1e-4)
    got = triton_lora.expand_planned(full[:, :80], full[:, 80:], device_plan, b.to(DEVICE), bounds.to(DEVICE), 4,
                                     a.shape[1]).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_fused_decode_weight_and_finish_stand_in_for_the_layer():
    """The contract a batch-1 GEMV caller (fused_decode) may use: the product of ``x`` and
    ``fused_decode_weight`` turned into the output by ``finish_fused_decode`` is the layer's output, on a
    step with adapters (the stacked weight, then the expand) and on one without (the base weight)."""
    layer = QKVLinear(hidden_size=16, head_dim=16, num_heads=4, num_kv_heads=2, bias=False)
    torch.nn.init.normal_(layer.weight)
    step = LoRAStep(capacity=4, device=torch.device("cpu"), planned=True)
    step.allocate(num_slots=2, max_ranks_per_layer=12)
    method = LoRALinearMethod(layer.method, layer, num_slots=2, max_rank=4, step=step, dtype=torch.float32,
                              device=torch.device("cpu"))
    assert method.stack_a_under_weight(layer)
    layer.method = method
    method.load_slot(1, [ShardLoRA(0, 0, torch.randn(4, 16), torch.randn(4, 64)),
                         ShardLoRA(2, 96, torch.randn(3, 16), torch.randn(3, 32))])
    x = torch.randn(1, 16)
    for slot in (1, -1):
        step.begin_sequences([slot], [1])
        expected = layer(x).clone()
        weight = method.fused_decode_weight(layer, x)
        assert weight.shape[0] == (128 + 2 * 12 if slot >= 0 else 128)
        torch.testing.assert_close(method.finish_fused_decode(x @ weight.T), expected, rtol=1e-5, atol=1e-5)
        step.end()


def test_one_row_base_only_steps_of_a_lora_mlp_take_the_base_engines_swiglu_epilogue(monkeypatch):
    """fused_decode's batch-1 MLP on a LoRA-wrapped gated MLP: a step without adapters is the plain model's
    (the RMSNorm + gate_up + SwiGLU-epilogue GEMV and the down GEMV, bit for bit the unwrapped MLP's output);
    a step with an adapter takes the LoRA path (no epilogue GEMV) and adds the update."""
    from hearth_llm.engine.models import fused_decode
    from hearth_llm.engine.models.lora_linear import wrap_with_lora
    from hearth_llm.engine.models.mlp import GatedMLP
    from hearth_llm.engine.models.norms import RMSNorm

    gemv = pytest.importorskip("hearth_llm.kernels.gemv.triton_gemv")
    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", frozenset({DEVICE}))
    epilogue_calls = []
    epilogue = gemv.rms_norm_linear_silu_and_mul
    monkeypatch.setattr(gemv, "rms_norm_linear_silu_and_mul",
                        lambda *args: epilogue_calls.append(1) or epilogue(*args))
    torch.manual_seed(6)
    mlp = GatedMLP(hidden_size=32, intermediate_size=48)
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        for layer in (mlp.gate_up_proj, mlp.down_proj):
            layer.weight.normal_()
        norm.weight.normal_()
    plain_mlp = GatedMLP(hidden_size=32, intermediate_size=48)  # (a deep copy would copy the DENSE method too)
    plain_mlp.load_state_dict(mlp.state_dict())
    plain_mlp = plain_mlp.to(DEVICE)
    mlp, norm = mlp.to(DEVICE), norm.to(DEVICE)
    step = LoRAStep(capacity=4, device=torch.device(DEVICE), planned=True)
    methods = wrap_with_lora(mlp, num_slots=2, max_rank=4, step=step)
    shards = {"gate_up_proj": [ShardLoRA(0, 0, torch.randn(3, 32), torch.randn(3, 48))],
              "down_proj": [ShardLoRA(0, 0, torch.randn(4, 48), torch.randn(4, 32))]}
    for name, method in methods.items():
        method.load_slot(0, shards[name])
    x, residual = torch.randn(1, 32).to(DEVICE), torch.randn(1, 32).to(DEVICE)
    expected, expected_residual = fused_decode.norm_and_mlp(norm, plain_mlp, x, residual)
    assert epilogue_calls == [1]
    step.begin_sequences([-1], [1])
    got, got_residual = fused_decode.norm_and_mlp(norm, mlp, x, residual)
    step.end()
    assert epilogue_calls == [1, 1]
    assert torch.equal(got, expected) and torch.equal(got_residual, expected_residual)
    step.begin_sequences([0], [1])
    with_adapter, _ = fused_decode.norm_and_mlp(norm, mlp, x, residual)
    step.end()
    assert epilogue_calls == [1, 1]  # the LoRA path: its SwiGLU adds gate_up's update
    summed = (x + residual).cpu()
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.cpu()
    gate_up = normed @ plain_mlp.gate_up_proj.weight.detach().cpu().T
    gate_up[:, :48] += (normed @ shards["gate_up_proj"][0].a.T) @ shards["gate_up_proj"][0].b_scaled
    act = torch.nn.functional.silu(gate_up[:, :48]) * gate_up[:, 48:]
    reference_out = act @ plain_mlp.down_proj.weight.detach().cpu().T
    reference_out += (act @ shards["down_proj"][0].a.T) @ shards["down_proj"][0].b_scaled
    torch.testing.assert_close(with_adapter.cpu(), reference_out, rtol=1e-3, atol=1e-2)
