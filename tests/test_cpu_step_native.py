"""Every decoder layer of a CPU step in one C call (``cpu_step_native.DecoderLayers``) where each linear
runs the GGUF C GEMVs (bf16: the bf16-out kernels; float32: the float32 kernels and the AVX2 panels): the
same bits as the Python layer loop of ``cpu_step.run_layers`` (hidden, residual and the KV caches it
writes) for one row, a verification's five and a batch of two sequences, with a qkv bias and Qwen3's
per-head norms too; and the engine on it gives HF transformers' greedy tokens on the dequantized
weights (fp32)."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import save_file

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.loader import load_checkpoint
from hearth_llm.engine.loader.model_loader import load_model
from hearth_llm.engine.models import cpu_step
from hearth_llm.engine.models.attention import AttentionMetadata
from hearth_llm.engine.models.norms import RMSNorm
from hearth_llm.kernels import cpu_step_native
from hearth_llm.kernels.quant import gguf_cpu_native

from conftest import TINY_VOCAB, hf_greedy, random_prompts
from gguf_writer import add_block_layers, add_q8_0_embedding_and_norm, tiny_llama_writer, write_and_close
from test_quant_gguf import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, _layer_blocks, random_blocks

pytestmark = pytest.mark.skipif(not (gguf_cpu_native.available() and cpu_step_native.available()),
                                reason="needs the C kernels (no C compiler here)")
HAS_BF16 = gguf_cpu_native.available() and gguf_cpu_native.has_bf16("Q4_K")
DTYPES = [pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not HAS_BF16, reason="bf16 GEMVs need AVX-512 BF16"),
                       id="bf16"), pytest.param(torch.float32, id="fp32")]

# (q, k, v, o, gate, up, down) per layer, every type with a bf16-out GEMV; fused qkv and gate_up of two runs.
NATIVE_TYPES = [("Q4_K", "Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q8_0"),
                ("Q6_K", "Q6_K", "Q6_K", "Q4_K", "Q4_1", "Q4_1", "Q4_K"),
                ("Q8_0", "Q8_0", "Q8_0", "Q6_K", "Q8_0", "Q4_K", "Q6_K")]
# A float32 model keeps Q4_0/Q4_1/Q8_0 layers as panels (AVX2) and K-quant ones in blocks (the AVX2 K GEMVs).
FLOAT32_TYPES = [("Q8_0", "Q8_0", "Q4_1", "Q4_0", "Q4_0", "Q4_1", "Q8_0"),
                 ("Q4_1", "Q4_1", "Q4_1", "Q8_0", "Q4_1", "Q4_1", "Q4_0"),
                 ("Q4_K", "Q4_K", "Q6_K", "Q5_K", "Q4_K", "Q6_K", "Q6_K")]
BLOCK_SIZE, NUM_BLOCKS = 16, 12


def _write(root, name: str, layer_types, head_type: str):
    """A tiny Llama GGUF of ``layer_types`` (its head ``head_type`` blocks) and an HF directory of its
    dequantized weights."""
    path = root / f"{name}.gguf"
    writer = tiny_llama_writer(path, HIDDEN, INTERMEDIATE, len(layer_types), HEADS, KV_HEADS)
    add_q8_0_embedding_and_norm(writer, TINY_VOCAB, HIDDEN)
    head = random_blocks(head_type, TINY_VOCAB, HIDDEN, seed=97, scale=3e-3).numpy()
    writer.add_tensor("output.weight", head, raw_dtype=GGMLQuantizationType[head_type])
    add_block_layers(writer, layer_types, HIDDEN, _layer_blocks)
    write_and_close(writer)
    checkpoint = load_checkpoint(str(path), torch.float32, progress=False)
    hf_dir = root / f"{name}-dequantized-hf"
    checkpoint.config.save_pretrained(hf_dir)
    tensors = {name: (t.dequantized(torch.float32) if hasattr(t, "dequantized") else t).contiguous()
               for name, t in checkpoint.weights()}
    save_file(tensors, str(hf_dir / "model.safetensors"))
    return path, hf_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """By dtype: the file its model keeps every linear of in blocks, and its HF reference directory."""
    root = tmp_path_factory.mktemp("cpu_step_native")
    return {torch.bfloat16: _write(root, "bf16-types", NATIVE_TYPES, "Q6_K"),
            torch.float32: _write(root, "float32-types", FLOAT32_TYPES, "Q8_0")}


def _model(path, dtype):
    model, arch = load_model(load_checkpoint(str(path), dtype, progress=False), torch.device("cpu"), dtype)
    return model, arch


def _meta(tables: torch.Tensor, starts: list[int], counts: list[int]):
    """Positions and metadata of one step: sequence b's ``counts[b]`` new tokens after ``starts[b]`` cached ones."""
    positions = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)])
    owners = torch.cat([torch.full((c,), b) for b, c in enumerate(counts)])
    slots = tables[owners, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    ends = [s + c for s, c in zip(starts, counts)]
    return positions, AttentionMetadata(
        slot_mapping=slots, block_tables=tables, context_lens=torch.tensor(ends),
        query_start_loc=torch.tensor([0] + list(torch.tensor(counts).cumsum(0))), max_query_len=max(counts),
        max_context_len=max(ends))


def _both_ways(model, arch, counts: list[int], monkeypatch, dtype) -> None:
    """One step of ``counts`` new rows per sequence after a prefill of each, natively and by the Python
    loop from the same caches: the outputs and the caches written must be bit-equal."""
    caches = [tuple(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim, dtype=dtype)
                    for _ in range(2)) for _ in range(arch.num_hidden_layers)]
    tables = torch.tensor([[5, 2, 7], [0, 9, 3]])[:len(counts)]
    contexts = [37, 21][:len(counts)]
    generator = torch.Generator().manual_seed(sum(counts))
    ids = [torch.randint(0, arch.vocab_size, (n,), generator=generator) for n in contexts]
    with torch.inference_mode():
        for b, seq in enumerate(ids):  # each prefix by the layers' own forward (a prefill of one sequence)
            positions, meta = _meta(tables[b:b + 1], [0], [len(seq) - counts[b]])
            model(seq[:len(seq) - counts[b]], positions, caches, meta)
        saved = [(k.clone(), v.clone()) for k, v in caches]
        positions, meta = _meta(tables, [n - c for n, c in zip(contexts, counts)], counts)
        step_ids = torch.cat([seq[len(seq) - c:] for seq, c in zip(ids, counts)])
        hidden = model.embed(step_ids)
        calls = []
        run = cpu_step_native.DecoderLayers.run
        monkeypatch.setattr(cpu_step_native.DecoderLayers, "run", lambda *a: calls.append(1) or run(*a))
        native = cpu_step.run_layers(model, hidden, positions, caches, meta)
        assert calls == [1]
        native_caches = [(k.clone(), v.clone()) for k, v in caches]
        for (k, v), (k0, v0) in zip(caches, saved):
            k.copy_(k0), v.copy_(v0)
        monkeypatch.setattr(cpu_step, "NATIVE_LAYERS", False)
        loop = cpu_step.run_layers(model, hidden, positions, caches, meta)
        monkeypatch.setattr(cpu_step, "NATIVE_LAYERS", True)
    assert calls == [1]
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for mine, theirs in zip(native, loop):
        assert mine.dtype == dtype and torch.equal(mine.view(bits), theirs.view(bits))
    for (k, v), (k1, v1) in zip(native_caches, caches):
        assert torch.equal(k.view(bits), k1.view(bits)) and torch.equal(v.view(bits), v1.view(bits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[1], [5], [1, 1], [3, 2]])
def test_native_layers_give_the_python_loops_bits(files, counts, dtype, monkeypatch):
    model, arch = _model(files[dtype][0], dtype)
    _both_ways(model, arch, counts, monkeypatch, dtype)
    if dtype == torch.float32 and gguf_cpu_native.has_panels("Q4_1"):  # the pure Q4/Q8_0 linears ran on panels
        plan = model.__dict__["_cpu_step_native"]
        assert any(layer.gate_up.kind[0] == 1 for layer in plan._layers)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_layers_add_a_qkv_bias_and_norm_query_and_key_heads_as_the_loop_does(files, dtype, monkeypatch):
    """Qwen2's qkv bias and Qwen3's per-head q/k RMSNorms, put on the tiny Llama's layers."""
    model, arch = _model(files[dtype][0], dtype)
    generator = torch.Generator().manual_seed(4)
    for layer in model.layers:
        attn = attn_layer = layer.self_attn
        qkv = attn.qkv_proj
        qkv.bias = torch.nn.Parameter((torch.randn(qkv.output_size_per_rank, generator=generator) * 0.5).to(dtype),
                                      requires_grad=False)
        qkv.routine = qkv.method_routine = qkv.method.forward_routine(qkv)  # bound anew with the bias
        for name in ("q_norm", "k_norm"):
            norm = RMSNorm(arch.head_dim, 1e-6).to(dtype)
            norm.weight.data = (1 + torch.randn(arch.head_dim, generator=generator) * 0.3).to(dtype)
            setattr(attn_layer, name, norm)
    model.__dict__.pop("_cpu_step_layers", None)
    model.__dict__.pop("_cpu_step_native", None)
    _both_ways(model, arch, [3, 1], monkeypatch, dtype)
    assert cpu_step._native_layers(model, cpu_step._plain_layers(model)) is not None


@pytest.mark.skipif(not HAS_BF16, reason="bf16 GEMVs need AVX-512 BF16")
def test_a_linear_without_a_bf16_out_gemv_keeps_the_python_loop(tmp_path):
    """One Q5_0 tensor (no bf16 kernel) in a bf16 model: no native plan, and the step still runs (the loop)."""
    path = tmp_path / "q5.gguf"
    types = [NATIVE_TYPES[0][:3] + ("Q5_0",) + NATIVE_TYPES[0][4:]]
    writer = tiny_llama_writer(path, HIDDEN, INTERMEDIATE, 1, HEADS, KV_HEADS)
    add_q8_0_embedding_and_norm(writer, TINY_VOCAB, HIDDEN)
    add_block_layers(writer, types, HIDDEN, _layer_blocks)
    write_and_close(writer)
    model, arch = _model(path, torch.bfloat16)
    assert cpu_step._native_layers(model, cpu_step._plain_layers(model)) is None
    caches = [tuple(torch.zeros(4, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim, dtype=torch.bfloat16)
                    for _ in range(2))]
    positions, meta = _meta(torch.tensor([[1, 0]]), [0], [2])
    with torch.inference_mode():
        assert cpu_step.run_layers(model, model.embed(torch.tensor([3, 4])), positions, caches, meta) is not None


def test_dense_linears_keep_the_python_loop(tiny_model_dirs):
    model, arch = _model(tiny_model_dirs["llama"], torch.float32)
    layers = cpu_step._plain_layers(model)
    assert layers is not None and cpu_step._native_layers(model, layers) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_run_refuses_hidden_rows_that_do_not_fit_the_step(files, dtype):
    model, arch = _model(files[dtype][0], dtype)
    plan = cpu_step._native_layers(model, cpu_step._plain_layers(model))
    positions, meta = _meta(torch.tensor([[1, 0]]), [0], [2])
    step = cpu_step_native.AttentionStep.of(positions, meta.slot_mapping, meta.query_start_loc, meta.context_lens,
                                            meta.block_tables)
    caches = [tuple(torch.zeros(4, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim, dtype=dtype)
                    for _ in range(2)) for _ in range(arch.num_hidden_layers)]
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="does not fit this step"):
        plan.run(torch.zeros(3, HIDDEN, dtype=dtype), step, caches)
    with pytest.raises(ValueError, match="does not fit this step"):
        plan.run(torch.zeros(2, HIDDEN, dtype=other), step, caches)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_engine_on_native_layers_gives_hf_greedy_tokens(files, dtype, monkeypatch):
    path, hf_dir = files[dtype]
    calls = []
    run = cpu_step_native.DecoderLayers.run
    monkeypatch.setattr(cpu_step_native.DecoderLayers, "run", lambda *a: calls.append(a[1].shape[0]) or run(*a))
    prompts = random_prompts(3, [5, 40, 9], seed=41)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(path), dtype=str(dtype).removeprefix("torch."), device="cpu", show_progress=False) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params, use_tqdm=False)
    assert 3 in calls and 1 in calls  # decode steps of the batch and of one sequence
    for prompt, output in zip(prompts + prompts[:1], outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_dir, prompt, 6), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[1], [5], [3, 2]])
def test_int8_activation_routines_run_in_the_native_loop_with_the_python_loops_bits(files, monkeypatch, counts, dtype):
    """``cpu_int8_activations=True`` swaps the layers' routines for the int8 kernels on packed panels: the
    one C call runs those (the same kernel on the same panels), not the exact GEMVs, bit-equal to the loop.
    In float32 the Q4_0/Q4_1/Q8_0 layers' int8 panels are made from their float32 panels, the K-quant ones'
    from their blocks; a Q5_K layer keeps its exact kernel beside them in the same C call."""
    from hearth_llm.engine.models.gguf_linear_method import use_int8_activations
    from hearth_llm.engine.models.linear import linear_layers
    from hearth_llm.kernels.quant import gguf_cpu_q8x

    if not gguf_cpu_q8x.has_panels():
        pytest.skip("needs the int8-activation panel kernels (AVX-512 VNNI or AVX2)")
    model, arch = _model(files[dtype][0], dtype)
    exact = cpu_step._native_layers(model, cpu_step._plain_layers(model))
    model.__dict__.pop("_cpu_step_native")
    assert use_int8_activations(model) > 0
    routines = {name: layer.routine.__name__ for name, layer in linear_layers(model)}
    if dtype == torch.float32:  # the layers all of whose types have int8 kernels here (not Q5_K; Q8_0 not on AVX2)
        linears = (("self_attn.qkv_proj", slice(0, 3)), ("self_attn.o_proj", slice(3, 4)),
                   ("mlp.gate_up_proj", slice(4, 6)), ("mlp.down_proj", slice(6, 7)))
        expected = {f"layers.{index}.{name}": all(gguf_cpu_q8x.supports(t, 16) for t in types[part])
                    for index, types in enumerate(FLOAT32_TYPES) for name, part in linears}
        assert {name: routine == "int8_or_fallback" for name, routine in routines.items()} == expected
        assert not expected["layers.2.self_attn.o_proj"] and expected["layers.1.mlp.gate_up_proj"]
    native = cpu_step._native_layers(model, cpu_step._plain_layers(model))
    assert native is not None and native is not exact
    _both_ways(model, arch, counts, monkeypatch, dtype)
    # and not the exact kernels' bits: the int8 step differs from the exact one
    model.__dict__["_cpu_step_native"] = exact
    with torch.inference_mode():
        ids = torch.arange(3) % arch.vocab_size
        caches = [tuple(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim,
                                    dtype=dtype) for _ in range(2)) for _ in range(arch.num_hidden_layers)]
        positions, meta = _meta(torch.tensor([[5, 2, 7]]), [0], [3])
        hidden = model.embed(ids)
        with_exact = cpu_step.run_layers(model, hidden, positions, [tuple(c.clone() for c in kv) for kv in caches], meta)
        model.__dict__["_cpu_step_native"] = native
        with_int8 = cpu_step.run_layers(model, hidden, positions, caches, meta)
    assert not torch.equal(with_exact[0], with_int8[0])
