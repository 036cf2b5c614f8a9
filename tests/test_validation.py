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


def test_generation_stops_at_max_model_len(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], max_model_len=20)
    out = llm.generate([[5] * 15], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


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
