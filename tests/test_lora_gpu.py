"""LoRA on CUDA (skipped without it): adapters written as PEFT directories without peft (the GPU
machine has none), checked against the base model with the adapter merged into its weights
(``W + scale * B @ A``), fp32, with CUDA graphs and async scheduling on as they are by default.
Prompts over 128 tokens take prefill-sized tiles, decode steps small tiles with split K; base-only steps
replay the graph set captured without the LoRA kernels."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from hearth_llm.engine import LLM, LoRARequest, SamplingParams

from conftest import TINY_COMMON, random_prompts, tiny_tokenizer
from model_equality import save_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MAX_NUM_SEQS = 16  # graphs of 1-16 rows: fewer captures and kernel compilations (the tests' slot on the GPU is short)


def write_adapter_and_merged(base_dir, root, name, seed, r, alpha, use_rslora, targets):
    """A PEFT directory for ``base_dir`` and an HF directory with the same adapter merged in."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    scale = alpha / math.sqrt(r) if use_rslora else alpha / r
    tensors = {}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if module_name.split(".")[-1] in targets:
                a = torch.randn(r, module.in_features) * 0.3
                b = torch.randn(module.out_features, r) * 0.3
                tensors[f"base_model.model.{module_name}.lora_A.weight"] = a
                tensors[f"base_model.model.{module_name}.lora_B.weight"] = b
                module.weight += scale * b @ a
    adapter = root / name
    adapter.mkdir()
    save_file(tensors, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": use_rslora, "target_modules": targets}))
    merged = root / f"{name}-merged"
    model.save_pretrained(merged)
    tiny_tokenizer().save_pretrained(merged)
    return str(adapter), str(merged)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_gpu")
    config = LlamaConfig(**{**TINY_COMMON, "max_position_embeddings": 2048}, architectures=["LlamaForCausalLM"])
    base = save_tiny_model(config, root / "base", seed=5)
    all_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {"a": write_adapter_and_merged(base, root, "a", 1, 8, 16, False, all_targets),
                "b": write_adapter_and_merged(base, root, "b", 2, 4, 8, True, ["q_proj", "v_proj", "down_proj"])}
    return str(base), adapters


def _tokens(model, prompts, loras=None, **kwargs) -> list[list[int]]:
    with LLM(model, dtype="float32", show_progress=False, max_num_seqs=MAX_NUM_SEQS, **kwargs) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]


def test_mixed_batch_on_cuda_matches_the_merged_models(models):
    base, adapters = models
    prompts = random_prompts(9, [150, 7, 300, 1, 40, 133], seed=41)
    names = ["a", "b", None, "a", None, "b", "a", "b", None]
    loras = [None if n is None else LoRARequest(n, adapters[n][0]) for n in names]
    got = _tokens(base, prompts, loras, enable_lora=True, max_loras=2, max_lora_rank=8)
    expected = {None: _tokens(base, prompts), **{n: _tokens(adapters[n][1], prompts) for n in adapters}}
    for index, name in enumerate(names):
        assert got[index] == expected[name][index], (index, name)
    assert expected["a"][0] != expected[None][0]


def test_decode_graphs_replay_with_adapters_captured_before_any_was_loaded(models):
    base, adapters = models
    prompts = random_prompts(4, [5, 9], seed=42)  # short: decode steps replay the graphs
    loras = [LoRARequest("a", adapters["a"][0]), None, LoRARequest("b", adapters["b"][0]), LoRARequest("a")]
    with LLM(base, dtype="float32", show_progress=False, max_num_seqs=MAX_NUM_SEQS, enable_lora=True, max_loras=2,
             max_lora_rank=8) as llm:
        assert llm.engine.runner.decode_graphs is not None
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]
    for prompt_tokens, lora, prompt in zip(got, ["a", None, "b", "a"], prompts):
        model = base if lora is None else adapters[lora][1]
        assert prompt_tokens == _tokens(model, [prompt])[0], lora


def test_base_only_steps_replay_the_graphs_without_lora_kernels(models):
    base, adapters = models
    prompts = random_prompts(3, [5, 9], seed=43)
    replays = {"base": 0, "lora": 0}
    with LLM(base, dtype="float32", show_progress=False, max_num_seqs=MAX_NUM_SEQS, enable_lora=True, max_loras=2,
             max_lora_rank=8) as llm:
        graphs = llm.engine.runner.decode_graphs
        for key, graph_set in (("base", graphs.base), ("lora", graphs.with_adapters)):
            def counted(*inputs, _run=graph_set.run, _key=key):
                replays[_key] += 1
                return _run(*inputs)
            graph_set.run = counted
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert replays["base"] > 0 and replays["lora"] == 0
        [with_a] = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", adapters["a"][0]))
        assert replays["lora"] > 0
    assert got == _tokens(base, prompts)
    assert with_a.outputs[0].token_ids == _tokens(adapters["a"][1], prompts[:1])[0]


def test_pdl_launches_of_the_expands_keep_the_tokens(models, monkeypatch):
    """With programmatic dependent launch (the expands start while the kernel before them finishes and wait
    for its outputs), mixed batches and batch-1 decode in CUDA graphs give the tokens of plain launches."""
    from hearth_llm.kernels.lora import triton_lora

    base, adapters = models
    prompts = random_prompts(5, [150, 7, 1, 40], seed=44)
    names = ["a", None, "b", "a", None]
    loras = [None if n is None else LoRARequest(n, adapters[n][0]) for n in names]
    kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    monkeypatch.setattr(triton_lora, "USE_PDL", False)
    plain = _tokens(base, prompts, loras, **kwargs) + _tokens(base, prompts[:1], loras[:1], **kwargs)
    monkeypatch.setattr(triton_lora, "USE_PDL", True)
    assert triton_lora._pdl(torch.zeros(1, device="cuda"))  # (an H200: Hopper)
    with_pdl = _tokens(base, prompts, loras, **kwargs) + _tokens(base, prompts[:1], loras[:1], **kwargs)
    assert with_pdl == plain
