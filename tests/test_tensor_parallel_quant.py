"""Tensor parallelism with quantized weights on the CPU (two gloo ranks, fp32 activations).

* A tiny Llama GGUF holding all eight llama.cpp block types: TP=2 run from its blocks
  (``quantization="gguf"``) and TP=2 dequantized at load give the greedy tokens (and close
  log-probabilities) of TP=1, each rank holding half the blocks. Row-parallel layers are split
  on block boundaries; a boundary inside a K-quant super-block is refused by layer name.
* AWQ and GPTQ checkpoints (W4G128 blocks, split on 128-groups) token-equal to HF on the
  dequantized model.
* FP8 and GPTQ act-order are refused by name before any worker starts.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import LlamaConfig

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.memory.weights import weights_bytes

from conftest import TINY_COMMON, TINY_VOCAB, hf_greedy, random_prompts
from gguf_writer import add_block_layers, tiny_llama_writer, write_and_close
from test_quant_awq_gptq import write_int4_dirs
from test_quant_gguf import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, _layer_blocks, _quantized

CPU = dict(device="cpu", dtype="float32", show_progress=False)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
# (q, k, v, o, gate, up, down) per layer: all eight types; row-parallel o (128 columns per rank) in
# 32-value blocks, down (256 per rank) also in a K-quant; layer 0's qkv mixes Q4_K and Q6_K.
SPLITTABLE = [("Q4_K", "Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_K"),
              ("Q5_0", "Q5_0", "Q5_1", "Q4_1", "Q6_K", "Q6_K", "Q6_K")]
# o_proj in Q5_K: 128 columns per rank is half a 256-value super-block.
CUT_INSIDE_A_BLOCK = [("Q4_K", "Q4_K", "Q6_K", "Q5_K", "Q4_0", "Q4_1", "Q8_0")] * 2


def write_gguf(path, layer_types) -> str:
    writer = tiny_llama_writer(path, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS)
    generator = torch.Generator().manual_seed(0)
    writer.add_tensor("token_embd.weight", torch.randn(TINY_VOCAB, HIDDEN, generator=generator).numpy())
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor("output.weight", _quantized("Q8_0", (TINY_VOCAB, HIDDEN), seed=99),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    add_block_layers(writer, layer_types, HIDDEN, _layer_blocks)
    write_and_close(writer)
    return str(path)


# Batches of >= 3 rows in every step: the CPU block kernels' tiled path, which cuts nothing by row
# count (1-2 row steps take numba's GEMV, whose per-process JIT compile would cost ~15 s per rank here).
PROMPTS = random_prompts(4, [5, 17, 1, 9], seed=21)


def _run(path, **kwargs):
    """Tokens, log-probs and each rank's weight bytes."""
    with LLM(path, **CPU, **kwargs) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        runner = llm.engine.runner
        rank_bytes = getattr(runner, "rank_weights_bytes", None) or [weights_bytes(runner.model)]
    tokens = [out.outputs[0].token_ids for out in outputs]
    logprobs = [[step[t].logprob for t, step in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
                for out in outputs]
    return tokens, logprobs, rank_bytes


@pytest.fixture(scope="module")
def splittable_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("tp_gguf") / "splittable.gguf", SPLITTABLE)


@pytest.mark.parametrize("quantization", ["gguf", None])  # kept as blocks / dequantized at load
def test_tp2_gguf_equals_tp1_for_every_block_type(splittable_gguf, quantization):
    tokens, logprobs, (single_bytes,) = _run(splittable_gguf, quantization=quantization)
    tp_tokens, tp_logprobs, rank_bytes = _run(splittable_gguf, quantization=quantization, tensor_parallel_size=2)
    assert tp_tokens == tokens
    np.testing.assert_allclose(np.concatenate(tp_logprobs), np.concatenate(logprobs), atol=1e-4)
    # Each rank: half the blocks. 0.65, not 0.6: where the AVX2 float32 panels run, TP=1 keeps its Q8_0
    # head as blocks while each rank's vocab-parallel head shard is dense float32.
    assert len(rank_bytes) == 2 and max(rank_bytes) < 0.65 * single_bytes


def test_a_rank_boundary_inside_a_k_quant_block_is_refused_by_layer_name(tmp_path):
    path = write_gguf(tmp_path / "cut.gguf", CUT_INSIDE_A_BLOCK)
    with pytest.raises(ValueError, match=r"'layers.0.self_attn.o_proj' inside its Q5_K blocks: each rank's 128 of "
                                         r"its 256 input columns must be whole blocks of 256"):
        LLM(path, **CPU, quantization="gguf", tensor_parallel_size=2)


# --- AWQ / GPTQ ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory):
    return build_int4_dirs(tmp_path_factory.mktemp("tp_int4"))


def build_int4_dirs(root) -> dict:
    """{"dense": the dequantized model, "awq": ..., "gptq": ...}: hidden 256, so each rank's o_proj
    input (128) and down_proj input (256) are whole 128-groups (also tests/test_tensor_parallel_gpu.py)."""
    config = LlamaConfig(**{**TINY_COMMON, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE},
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return write_int4_dirs(config, root)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_tp2_int4_checkpoint_matches_hf_on_the_dequantized_model(int4_dirs, method):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(int4_dirs[method]), tensor_parallel_size=2, **CPU) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(int4_dirs["dense"], prompt, 8)


def test_gptq_act_order_is_refused_by_name(int4_dirs, tmp_path):
    path = tmp_path / "gptq_act_order"
    path.mkdir()
    for file in int4_dirs["gptq"].iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"desc_act=True\) cannot be split"):
        LLM(str(path), tensor_parallel_size=2, **CPU)


def test_fp8_is_refused_by_name_on_any_machine(int4_dirs):
    with pytest.raises(ValueError, match="quantization='fp8' cannot be combined with tensor_parallel_size=2"):
        LLM(str(int4_dirs["dense"]), tensor_parallel_size=2, quantization="fp8", **CPU)
