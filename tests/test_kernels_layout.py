"""The kernels' layout and their one dispatch point: ops laid out by package (reference, CPU routine
and Triton kernel side by side), ``kernels/`` importing nothing of ours, the legacy module names
still working, and ``kernels.linear`` choosing its routine by the weight's format."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hearth_llm import kernels
from hearth_llm.kernels import cpu_ops

KERNELS = Path(kernels.__file__).resolve().parent
OPS = ["activation", "attention", "attention_inputs", "kv_cache", "matmul", "norm", "rotary", "sampling"]


def imports_of(path: Path) -> set[str]:
    """The absolute module names a kernels file imports (relative imports resolved)."""
    package = ".".join(["hearth_llm.kernels", *path.relative_to(KERNELS).parts[:-1]])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            names.add(base)
    return names


def test_kernels_import_nothing_of_ours_outside_kernels():
    for path in KERNELS.rglob("*.py"):
        ours = {name for name in imports_of(path) if name.startswith("hearth_llm")}
        outside = {name for name in ours if not name.startswith("hearth_llm.kernels")}
        assert not outside, f"{path.relative_to(KERNELS)} imports {outside}"


@pytest.mark.parametrize("op", OPS)
def test_each_op_keeps_its_reference_beside_its_other_routines(op):
    files = {path.name for path in (KERNELS / op).glob("*.py")}
    assert "reference.py" in files
    # flash_prefill.py: attention's long prefills on torch's bundled FlashAttention-2 (CUDA)
    assert files <= {"__init__.py", "reference.py", "cpu.py", "formats.py", f"triton_{op}.py", "flash_prefill.py"}, files


def test_legacy_modules_keep_the_names_callers_use():
    # engine/models and embeddings call these through kernels.cpu_ops.
    for name in ["pack_dense_weight", "dense_linear", "pack_fp16_weight", "fp16_linear", "int4_linear",
                 "int4_weight_if_lossless", "topk_indices", "has_onednn_bf16", "argmax", "paged_attention"]:
        assert callable(getattr(cpu_ops, name)), name
    from hearth_llm.kernels import reference, sampling
    assert callable(reference.paged_attention) and callable(sampling.sample_from_logits)


# --------------------------------------------------------------------------------------------
# kernels.linear: the routine by weight format and device
# --------------------------------------------------------------------------------------------


def on_int4_grid(rows: int, cols: int) -> torch.Tensor:
    codes = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(0)).float()
    codes[:, ::32], codes[:, 1::32] = 0, 15
    return (codes * 0.01 - 0.07).bfloat16()


def test_linear_of_a_dense_weight_is_f_linear():
    x, weight, bias = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    torch.testing.assert_close(kernels.linear(x, kernels.DenseWeight(weight), bias), F.linear(x, weight, bias))


@pytest.mark.skipif(not cpu_ops.has_onednn_bf16(), reason="no bf16 oneDNN on this CPU")
def test_linear_of_a_onednn_weight_matches_the_plain_weight():
    x, weight, bias = torch.randn(3, 64).bfloat16(), torch.randn(32, 64).bfloat16(), torch.randn(32).bfloat16()
    packed = kernels.OnednnBf16Weight.pack(weight)
    assert (packed.out_features, packed.in_features) == (32, 64)
    torch.testing.assert_close(kernels.linear(x, packed, bias).float(), F.linear(x, weight, bias).float(),
                               atol=2e-2, rtol=2e-2)


def test_linear_of_an_fp16_weight_is_the_weight_rounded_to_fp16_in_float32():
    plain = torch.randn(32, 64)
    weight = kernels.Fp16Weight.pack(plain)
    if weight is None:
        pytest.skip("no fbgemm in this torch build")
    x, bias = torch.randn(2, 64).bfloat16(), torch.randn(32)
    out = kernels.linear(x, weight, bias)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.float(), plain.half().float(), bias), atol=1e-2, rtol=1e-3)


def test_linear_of_an_int4_weight_matches_the_weight_it_holds_exactly():
    weight = on_int4_grid(64, 128)
    int4 = kernels.Int4Weight.if_lossless(weight)
    if int4 is None:
        pytest.skip("no int4 CPU kernel in this torch build")
    assert kernels.Int4Weight.if_lossless(torch.randn(64, 128).bfloat16()) is None
    x = torch.randn(2, 128).bfloat16()
    torch.testing.assert_close(kernels.linear(x, int4).float(), F.linear(x, weight).float(), atol=2e-2, rtol=2e-2)


def test_linear_refuses_a_format_with_no_routine_on_the_device():
    class Unknown:
        pass

    with pytest.raises(ValueError, match="no linear routine for weight format Unknown on cpu"):
        kernels.linear(torch.ones(1, 2), Unknown())
    packed = kernels.OnednnBf16Weight(torch.ones(1), 1, 1)
    with pytest.raises(ValueError, match="OnednnBf16Weight on meta"):
        kernels.linear(torch.ones(1, 2, device="meta"), packed)


def test_a_registered_format_is_multiplied_by_its_routine():
    class Transposed(kernels.DenseWeight):
        """Stored as [K, N]."""

    kernels.register_linear_routine(Transposed, "cpu", lambda x, w, bias: x @ w.weight)
    x, weight = torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(kernels.linear(x, Transposed(weight)), x @ weight)
