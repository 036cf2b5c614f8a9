"""Multi-LoRA serving: greedy tokens equal to HF transformers + PEFT (fp32, CPU) with adapters
made by ``peft`` on tiny random models, alone, mixed in one batch with the base model, across
prefix-cache hits and after removal; bad adapters refused before anything is queued."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config, Qwen3Config

from hearth_llm.engine import LLM, LoRARequest, SamplingParams

from conftest import TINY_COMMON, assert_pool_whole, hf_greedy, random_prompts
from model_equality import save_tiny_model

peft = pytest.importorskip("peft")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir, path, seed: int, r: int = 4, alpha: float = 8, target_modules=None, **fields):
    """A PEFT adapter with random (non-zero) A and B, saved the way users get them."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules or ALL_TARGETS,
                             init_lora_weights=False, **fields)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():  # peft's random init is small; spread it so the adapter changes greedy tokens
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(path)
    return str(path)


@functools.cache
def _peft_model(base_dir: str, adapter_dir: str):
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(base_dir, adapter_dir, prompt: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    """HF + PEFT greedy continuation, EOS ignored: the independent reference."""
    if adapter_dir is None:
        return hf_greedy(base_dir, prompt, max_new_tokens)
    model = _peft_model(str(base_dir), str(adapter_dir))
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_llama")
    base = save_tiny_model(LlamaConfig(**TINY_COMMON, architectures=["LlamaForCausalLM"]), root / "base", seed=3)
    adapters = {"a": make_adapter(base, root / "a", seed=1),
                "b": make_adapter(base, root / "b", seed=2, r=8, alpha=4, use_rslora=True,
                                  target_modules=["q_proj", "v_proj", "down_proj"])}
    return base, adapters


@pytest.fixture(scope="module")
def lora_llm(llama):
    base, _ = llama
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=8, show_progress=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def strict_llm(llama):
    """An engine that accepts ranks up to 4 only (adapter "b" has r=8)."""
    llm = LLM(str(llama[0]), enable_lora=True, max_loras=2, max_lora_rank=4, show_progress=False)
    yield llm
    assert_pool_whole(llm.stats())
    llm.close()


@pytest.fixture
def served(lora_llm, llama):
    yield lora_llm, *llama
    assert_pool_whole(lora_llm.stats())


def test_one_adapter_alone_matches_peft(served):
    llm, base, adapters = served
    prompt = random_prompts(1, [13], seed=21)[0]
    [out] = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", adapters["a"]))
    expected = peft_greedy(base, adapters["a"], prompt)
    assert out.outputs[0].token_ids == expected
    assert expected != peft_greedy(base, None, prompt), "the adapter must change the answer for this test to mean anything"
    assert out.lora_name == "a"


def test_mixed_batch_of_two_adapters_and_base_matches_peft(served):
    llm, base, adapters = served
    prompts = random_prompts(6, [5, 17, 9], seed=22)
    choice = [None, "a", "b", "a", None, "b"]
    loras = [None if name is None else LoRARequest(name, adapters[name]) for name in choice]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for prompt, name, out in zip(prompts, choice, outputs):
        assert out.outputs[0].token_ids == peft_greedy(base, adapters.get(name), prompt), name
        assert out.lora_name == name


def test_base_only_steps_run_no_lora_code_and_match_hf(served, monkeypatch):
    from hearth_llm.engine.models.lora_linear import LoRAStep

    llm, base, adapters = served
    calls = []
    add = LoRAStep.add
    monkeypatch.setattr(LoRAStep, "add", lambda self, *args: calls.append(1) or add(self, *args))
    prompts = random_prompts(3, [6, 11], seed=25)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert calls == []  # no adapter in the step: every wrapped layer is just its base method
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == peft_greedy(base, None, prompt)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", adapters["a"]))
    assert calls  # (the counter does see adapter steps)


def test_samples_of_one_request_share_its_adapter(served):
    llm, base, adapters = served
    prompt = random_prompts(1, [19], seed=32)[0]
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [out] = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("b", adapters["b"]))
    expected = peft_greedy(base, adapters["b"], prompt)
    assert [sample.token_ids for sample in out.outputs] == [expected, expected]


def test_prefix_cached_under_one_adapter_is_not_reused_by_another_or_base(served):
    llm, base, adapters = served
    prefix = random_prompts(1, [24], seed=23)[0]
    prompts = [prefix + suffix for suffix in random_prompts(3, [3, 5, 2], seed=24)]
    [first] = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", adapters["a"]))
    others = llm.generate(prompts[1:], GREEDY, use_tqdm=False, lora_request=[LoRARequest("b", adapters["b"]), None])
    assert [out.num_cached_tokens for out in others] == [0, 0]
    [again] = llm.generate(prompts[2:], GREEDY, use_tqdm=False, lora_request=LoRARequest("a"))
    assert again.num_cached_tokens == 24  # the same adapter does hit its own prefix
    for prompt, name, out in zip(prompts + prompts[2:], ["a", "b", None, "a"], [first, *others, again]):
        assert out.outputs[0].token_ids == peft_greedy(base, adapters.get(name), prompt), name


def test_more_adapters_than_slots_swap_and_keep_their_tokens(llama, tmp_path, make_llm):
    base, adapters = llama
    third = make_adapter(base, tmp_path / "c", seed=5, r=2, target_modules=["o_proj", "up_proj"])
    paths = {**adapters, "c": third}
    llm = make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = random_prompts(3, [7, 11, 4], seed=25)
    loras = [LoRARequest(name, path) for name, path in paths.items()]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for prompt, path, out in zip(prompts, paths.values(), outputs):
        assert out.outputs[0].token_ids == peft_greedy(base, path, prompt)
    assert llm.engine.lora_manager.num_slot_loads >= 3


def test_add_list_remove_while_idle(llama, make_llm):
    base, adapters = llama
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8)
    llm.add_lora(LoRARequest("a", adapters["a"]))
    assert llm.list_loras() == ["a"]
    prompt = random_prompts(1, [9], seed=26)[0]
    [by_name] = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("a"))
    assert by_name.outputs[0].token_ids == peft_greedy(base, adapters["a"], prompt)
    assert llm.remove_lora("a") and llm.list_loras() == []
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("a"))
    [base_out] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert base_out.outputs[0].token_ids == peft_greedy(base, None, prompt) and base_out.lora_name is None


def _bad_copy(adapter_dir, tmp_path, **config_changes):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(adapter_dir, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config.update(config_changes)
    (bad / "adapter_config.json").write_text(json.dumps(config))
    return str(bad)


def _bad_weights(adapter_dir, tmp_path, transform=None, raw: bytes | None = None):
    from safetensors.torch import load_file, save_file

    bad = _bad_copy(adapter_dir, tmp_path)
    weights = f"{bad}/adapter_model.safetensors"
    if raw is not None:
        open(weights, "wb").write(raw)
    else:
        save_file(transform(load_file(weights)), weights)
    return bad


def _renamed(tensors):
    return {key.replace("q_proj", "query_key_value"): value for key, value in tensors.items()}


def _narrowed(tensors):  # as if made for a base model with a smaller hidden size
    return {key: value[:, :32].contiguous() if "q_proj.lora_A" in key else value for key, value in tensors.items()}


@pytest.mark.parametrize("make_bad, message", [
    (lambda a, tmp: LoRARequest("nope"), "unknown LoRA adapter 'nope'"),
    (lambda a, tmp: LoRARequest("big", a["b"]), "r=8 is above max_lora_rank=4"),
    (lambda a, tmp: LoRARequest("dora", _bad_copy(a["a"], tmp, use_dora=True)), "use_dora"),
    (lambda a, tmp: LoRARequest("bias", _bad_copy(a["a"], tmp, bias="all")), "bias"),
    (lambda a, tmp: LoRARequest("pissa", _bad_copy(a["a"], tmp, init_lora_weights="pissa")), "init_lora_weights"),
    (lambda a, tmp: LoRARequest("pattern", _bad_copy(a["a"], tmp, rank_pattern={"q_proj": 2})), "rank_pattern"),
    (lambda a, tmp: LoRARequest("head", _bad_copy(a["a"], tmp, target_modules=["lm_head"])), "lm_head"),
    (lambda a, tmp: LoRARequest("gone", str(tmp / "missing")), "cannot read"),
    (lambda a, tmp: LoRARequest("other", _bad_weights(a["a"], tmp, _renamed)), "query_key_value is not a linear"),
    (lambda a, tmp: LoRARequest("narrow", _bad_weights(a["a"], tmp, _narrowed)), r"shape \(4, 32\)"),
    (lambda a, tmp: LoRARequest("corrupt", _bad_weights(a["a"], tmp, raw=b"\x00garbage")), "cannot be read"),
])
def test_bad_adapter_raises_before_anything_is_queued(llama, strict_llm, tmp_path, make_bad, message):
    base, adapters = llama
    llm = strict_llm
    prompts = random_prompts(2, [6], seed=27)
    num_prompt_tokens = llm.stats()["num_prompt_tokens"]
    bad = make_bad(adapters, tmp_path)
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[None, bad])
    assert llm.stats()["num_prompt_tokens"] == num_prompt_tokens and llm.list_loras() == []
    [out] = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # the engine keeps serving
    assert out.outputs[0].token_ids == peft_greedy(base, None, prompts[0])


FAMILIES = {
    # q/k norm after the projections an adapter changes
    "qwen3": (lambda: Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=True,
                                  architectures=["Qwen3ForCausalLM"]), ALL_TARGETS),
    # HF stores qkv_proj and gate_up_proj fused: the adapter's B covers all of the fused rows
    "phi3": (lambda: Phi3Config(**TINY_COMMON, sliding_window=12, partial_rotary_factor=0.75,
                                architectures=["Phi3ForCausalLM"]), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_alone_and_mixed_with_base_match_peft(family, tmp_path, make_llm):
    make_config, targets = FAMILIES[family]
    base = save_tiny_model(make_config(), tmp_path / "base", seed=6)
    adapter = make_adapter(base, tmp_path / "adapter", seed=9, target_modules=targets)
    llm = make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=4)
    prompts = random_prompts(3, [15, 6], seed=28)
    lora = LoRARequest(family, adapter)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[lora, None, lora])
    for prompt, path, out in zip(prompts, [adapter, None, adapter], outputs):
        assert out.outputs[0].token_ids == peft_greedy(base, path, prompt), path
    assert outputs[0].outputs[0].token_ids != peft_greedy(base, None, prompts[0])


def test_forced_preemption_with_adapters_keeps_their_tokens(llama, make_llm):
    base, adapters = llama
    with LLM(str(base), block_size=4, show_progress=False) as probe:
        bytes_per_block = probe.engine.runner.bytes_per_block
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4,
                   kv_cache_memory=14 * bytes_per_block, max_model_len=56)
    prompts = random_prompts(5, [20, 9, 14], seed=29)
    names = ["a", "b", None, "b", "a"]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False,
                           lora_request=[None if n is None else LoRARequest(n, adapters[n]) for n in names])
    assert llm.stats()["num_preemptions"] > 0
    for prompt, name, out in zip(prompts, names, outputs):
        assert out.outputs[0].token_ids == peft_greedy(base, adapters.get(name), prompt), name


def test_removing_an_adapter_while_its_request_runs_lets_it_finish(llama, make_engine):
    base, adapters = llama
    engine = make_engine(base, enable_lora=True, max_loras=2, max_lora_rank=8, async_scheduling=True)
    prompt = random_prompts(1, [12], seed=30)[0]
    request_id = engine.add_request(prompt, GREEDY, lora_request=LoRARequest("a", adapters["a"]))
    tokens = []
    for _ in range(3):
        tokens += [t for delta in engine.step() for t in delta.new_token_ids]
    assert engine.lora_manager.remove("a") and engine.lora_manager.list_names() == []
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        engine.add_request(prompt, GREEDY, lora_request=LoRARequest("a"))
    while engine.has_unfinished_requests():
        tokens += [t for delta in engine.step() for t in delta.new_token_ids]
    engine.release(request_id)
    assert tokens == peft_greedy(base, adapters["a"], prompt)


def test_planned_steps_with_the_shrink_stacked_under_the_weights_match_peft(llama, make_llm, monkeypatch):
    """The CUDA layer path, planned on the CPU: dense layers keep every slot's A under their weight, so the
    base GEMM also gives the rank-space rows and the expand adds into its (strided) output, which the model's
    later ops take as it is, except gate_up_proj's, whose update the SwiGLU adds on the way in; a mixed batch
    of two adapters and base, with prefill and decode steps."""
    from hearth_llm.engine.models.lora_linear import LoRALinearMethod, LoRAStep

    from hearth_llm.engine.models import lora_linear

    calls, activations = [], []
    stacked = LoRALinearMethod._apply_stacked
    monkeypatch.setattr(LoRALinearMethod, "_apply_stacked", lambda self, *args: calls.append(1) or stacked(self, *args))
    fused_activation = lora_linear.expand_silu_and_mul_planned
    monkeypatch.setattr(lora_linear, "expand_silu_and_mul_planned",
                        lambda *args: activations.append(1) or fused_activation(*args))
    init = LoRAStep.__init__
    monkeypatch.setattr(LoRAStep, "__init__", lambda self, capacity, device, planned=None: init(self, capacity, device,
                                                                                                  planned=True))
    base, adapters = llama
    # max_loras 3: not the config of the module's engine, which an LLM of the same config would share
    llm = make_llm(base, enable_lora=True, max_loras=3, max_lora_rank=8, block_size=8)
    assert llm.engine.runner.lora.step.is_planned
    methods = llm.engine.runner.lora.layers.values()
    assert methods and all(method.stacked_weight is not None for method in methods)
    prompts = random_prompts(4, [5, 17, 9], seed=26)
    choice = ["a", None, "b", "a"]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False,
                           lora_request=[None if name is None else LoRARequest(name, adapters[name]) for name in choice])
    for prompt, name, out in zip(prompts, choice, outputs):
        assert out.outputs[0].token_ids == peft_greedy(base, adapters.get(name), prompt), name
    assert calls  # the stacked path ran
    assert activations  # and the gated MLPs' SwiGLU added gate_up's update (no in-place expand there)


def test_one_row_steps_with_adapters_take_the_fused_batch1_gemvs(llama, make_llm, monkeypatch):
    """The CUDA batch-1 path, planned on the CPU with the fused decode GEMVs in the Triton interpreter: a
    LoRA layer lends fused_decode its stacked weight (the norm stays inside qkv_proj's GEMV) and turns the
    product into its output; one-row decode with an adapter, and of the base model, match PEFT and HF."""
    from hearth_llm.engine.models import fused_decode
    from hearth_llm.engine.models.lora_linear import LoRALinearMethod, LoRAStep
    from hearth_llm.kernels.gemv import triton_gemv

    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(triton_gemv, "default_launch", lambda *args: triton_gemv.GemvLaunch(256, 128))
    init = LoRAStep.__init__
    monkeypatch.setattr(LoRAStep, "__init__", lambda self, capacity, device, planned=None: init(self, capacity, device,
                                                                                                  planned=True))
    is_stacked = []  # per fused call: whether the GEMV's product had the stacked shrink columns
    finish = LoRALinearMethod.finish_fused_decode
    monkeypatch.setattr(LoRALinearMethod, "finish_fused_decode", lambda self, out: is_stacked.append(
        out.shape[1] > self.lora_b.shape[-1]) or finish(self, out))
    base, adapters = llama
    llm = make_llm(base, enable_lora=True, max_loras=3, max_lora_rank=8, block_size=8)
    prompt = random_prompts(1, [7], seed=3)[0]
    for name in ("a", None):
        is_stacked.clear()
        out = llm.generate([prompt], GREEDY, use_tqdm=False,
                           lora_request=None if name is None else LoRARequest(name, adapters[name]))
        assert out[0].outputs[0].token_ids == peft_greedy(base, adapters.get(name), prompt), name
        assert is_stacked and any(is_stacked) == (name is not None)  # stacked products only with an adapter
