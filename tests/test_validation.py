"""Bad input raises ValueError naming the parameter, before any engine state changes."""
import pytest

from hearth_llm.engine import EngineConfig, LLM, SamplingParams

from conftest import TINY_VOCAB


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 2.5),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("n", 0), ("n", 10_000),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 100),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("stop", [""]), ("stop", ["x"] * 100), ("stop", [3]), ("stop_token_ids", [-1]), ("seed", 1.5),
    ("max_tokens", True),
])
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("field, value", [
    ("block_size", 0), ("max_num_seqs", -1), ("max_num_batched_tokens", 0), ("dtype", "int3"),
    ("device", "tpu"), ("kv_cache_memory", "lots"), ("kv_cache_memory", -5), ("max_model_len", 0),
    ("async_scheduling", "yes"), ("cuda_graphs", 1), ("enable_prefix_caching", None),
])
def test_engine_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_unknown_engine_option_is_a_type_error():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM("default", max_num_seq=4)


def test_trust_remote_code_is_refused():
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM("default", trust_remote_code=True)


def test_pickled_weights_need_allow_pickle(tmp_path, tiny_model_dirs):
    import shutil

    import torch
    from safetensors.torch import load_file

    target = tmp_path / "pickled"
    shutil.copytree(tiny_model_dirs["llama"], target)
    weights = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    torch.save(weights, target / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle"):
        LLM(str(target), show_progress=False)
    assert LLM(str(target), allow_pickle=True, show_progress=False).engine.arch.num_hidden_layers == 2


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("prompt, match", [
    ("", "prompt"), ([], "prompt"), ([[]], "prompt"), ([[5, TINY_VOCAB]], "prompt token ids"),
    ([[-1]], "prompt token ids"), ([[5] * 2000], "max_model_len"), ([[1.5]], "prompt"),
])
def test_bad_prompts_are_refused_before_anything_is_queued(prompt, match, tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"])
    before = llm.stats()
    good = [5, 6, 7]
    with pytest.raises(ValueError, match=match):
        llm.generate([good, *prompt] if isinstance(prompt, list) and prompt else prompt, use_tqdm=False)
    assert llm.stats() == before
    # and the engine still serves
    assert len(llm.generate([good], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) >= 1


def test_duplicate_request_id_is_refused(tiny_model_dirs, make_engine):
    engine = make_engine(tiny_model_dirs["llama"])
    engine.add_request([5, 6], SamplingParams(max_tokens=1), request_id="same")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([5, 6], SamplingParams(max_tokens=1), request_id="same")
    engine.abort_request("same")
    engine.release("same")


def test_max_model_len_larger_than_the_cache_is_refused(tiny_model_dirs):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_model_dirs["llama"]), kv_cache_memory=4 * 8192, max_model_len=1000, show_progress=False)


def test_max_tokens_none_generates_to_the_end_of_the_context(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], max_model_len=20)
    out = llm.generate([[5] * 15], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_max_tokens_past_the_context_is_refused_before_anything_is_queued(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], max_model_len=20)
    before = llm.stats()
    with pytest.raises(ValueError, match="max_tokens=6 .* at most 5"):
        llm.generate([[5, 6], [5] * 15], SamplingParams(max_tokens=6), use_tqdm=False)
    assert llm.stats() == before
    out = llm.generate([[5] * 15], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5


async def test_async_max_tokens_past_the_context_names_max_tokens(tiny_model_dirs):
    from hearth_llm.engine import AsyncLLM

    engine = AsyncLLM(str(tiny_model_dirs["llama"]), max_model_len=20, show_progress=False)
    try:
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in engine.generate([5] * 15, SamplingParams(max_tokens=100)):
                pass
        pieces = [out async for out in engine.generate([5] * 15, SamplingParams(max_tokens=None, ignore_eos=True))]
        assert sum(len(p.delta_token_ids) for p in pieces) == 5
    finally:
        engine.close()


def _copy_model(tiny_model_dirs, tmp_path):
    import shutil

    target = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], target)
    return target


def test_corrupt_safetensors_is_a_value_error_naming_the_file(tiny_model_dirs, tmp_path):
    target = _copy_model(tiny_model_dirs, tmp_path)
    (target / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(target), show_progress=False)


def test_malformed_config_json_is_a_value_error(tiny_model_dirs, tmp_path):
    target = _copy_model(tiny_model_dirs, tmp_path)
    (target / "config.json").write_text("{ this is not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(target), show_progress=False)


def test_unsupported_architecture_is_named(tiny_model_dirs, tmp_path):
    import json

    target = _copy_model(tiny_model_dirs, tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        LLM(str(target), show_progress=False)


def _with_chat_template(tiny_model_dirs, tmp_path, template: str):
    from transformers import AutoTokenizer

    target = _copy_model(tiny_model_dirs, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(target)
    return target


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for m in messages %}{{ m.__class__.__init__.__globals__ }}{% endfor %}",
    "{{ messages.append({'role': 'x'}) }}",  # the sandbox is immutable: no changing the caller's data
])
def test_chat_templates_run_in_a_sandbox(template, tiny_model_dirs, tmp_path, make_llm):
    llm = make_llm(_with_chat_template(tiny_model_dirs, tmp_path, template))
    messages = [{"role": "user", "content": "w5 w6"}]
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    assert messages == [{"role": "user", "content": "w5 w6"}]
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) >= 1


def test_a_template_that_rejects_the_conversation_names_messages(tiny_model_dirs, tmp_path, make_llm):
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
                "{% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}")
    llm = make_llm(_with_chat_template(tiny_model_dirs, tmp_path, template))
    with pytest.raises(ValueError, match="messages.*first message must be from the user"):
        llm.chat([{"role": "assistant", "content": "w5"}], SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.chat([{"role": "user", "content": "w5 w6"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("messages, match", [
    ([], "messages"), ("hello", "messages"), ([{"content": "x"}], r"messages\[0\]"),
    ([{"role": "user", "content": "x"}, {"role": 3}], r"messages\[1\]"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\]"),
])
def test_malformed_chat_messages_name_the_message(messages, match, tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"])
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, use_tqdm=False)


@pytest.mark.parametrize("tools, match", [
    ([{"function": {"name": "f", "parameters": "not a schema"}}], "tools: the parameters of 'f'"),
    ([{"name": "f", "parameters": {"default": float("nan")}}], "tools: the parameters of 'f'"),
    ([{"name": "f", "description": 7}], "tools: the description of 'f'"),
    ([{"description": "no name"}], "tools: each tool needs a function name"),
])
def test_malformed_tools_name_the_tool(tools, match):
    from hearth_llm.engine.tool_calling import normalize_tools

    with pytest.raises(ValueError, match=match):
        normalize_tools(tools)
