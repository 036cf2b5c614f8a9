"""Cold start: the staged reads (reader threads, a ring of buffers, chunks across tensor and file
boundaries) give exactly the tensors the plain reads give, the fast random checkpoint is a valid HF
directory, and ``bench cold-start`` times every phase of a fresh process on a tiny model."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hearth_llm.benchmarks import cold_start
from hearth_llm.benchmarks.checkpoint_writer import write_random_checkpoint
from hearth_llm.engine.loader import hf_dir
from hearth_llm.engine.loader.hf_dir import load_hf_dir
from hearth_llm.engine.loader.staged_reads import ReadStats, TensorEntry, stream_to_device


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen3-sharded")
    write_random_checkpoint("tiny-qwen3", directory, shard_bytes=400_000)  # 1.46 MB: the embedding, the rest
    return directory


def entries_of(directory: Path) -> list[TensorEntry]:
    entries = []
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as reader:
            header = hf_dir._safetensors_entries(reader)
        entries += [TensorEntry(name, str(file), dtype, tuple(shape), start, end)
                    for name, (dtype, shape, start, end) in header.items()]
    return entries


def test_the_random_checkpoint_is_a_sharded_hf_directory(sharded_dir):
    checkpoint = load_hf_dir(sharded_dir, torch.bfloat16, progress=False)
    files = sorted(sharded_dir.glob("*.safetensors"))
    assert len(files) == 2 and checkpoint.config.num_hidden_layers == 2
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(checkpoint.weight_shapes())
    weights = dict(checkpoint.weights())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert torch.equal(weights["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert 0.015 < weights["model.embed_tokens.weight"].float().std().item() < 0.025


@pytest.mark.parametrize("chunk_bytes, num_buffers, num_threads", [(1000, 3, 2), (4096, 1, 1), (1 << 20, 16, 8)])
def test_staged_reads_give_the_plain_reads_tensors(sharded_dir, chunk_bytes, num_buffers, num_threads):
    plain = dict(load_hf_dir(sharded_dir, torch.bfloat16, progress=False).weights())
    stats = ReadStats()
    staged = list(stream_to_device(entries_of(sharded_dir), torch.device("cpu"), chunk_bytes=chunk_bytes,
                                   num_buffers=num_buffers, num_threads=num_threads, stats=stats))
    assert [name for name, _ in staged] == list(plain) and len(staged) == stats.num_tensors
    for name, tensor in staged:
        assert tensor.dtype == plain[name].dtype and torch.equal(tensor, plain[name]), name
    assert stats.num_bytes == sum(t.numel() * t.element_size() for t in plain.values())


def test_a_truncated_shard_is_a_value_error_naming_the_directory(sharded_dir, tmp_path):
    for file in sharded_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    last = sorted(tmp_path.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-100])
    files = sorted(tmp_path.glob("*.safetensors"))
    with pytest.raises(ValueError, match=str(tmp_path)):
        list(hf_dir._stream_safetensors_to_device(files, torch.device("cpu")))


def test_bench_cold_start_times_each_phase_of_a_fresh_process(sharded_dir, tmp_path, capsys):
    out = tmp_path / "cold.json"
    cold_start.main(["--model", str(sharded_dir), "--device", "cpu", "--repeats", "1", "--kv-cache-memory", "16MiB",
                     "--no-compile-bytecode",
                     "--json", str(out)])
    [run] = json.loads(out.read_text())["runs"].values()
    phases = run["phases"]
    for phase in ("python", "import torch", "import hearth_llm.engine", "config + tokenizer", "model build",
                  "weights", "engine rest", "first token"):
        assert phases[phase] > 0, phase
    assert run["total_s"] == pytest.approx(sum(phases.values()))
    assert run["total_s"] <= run["wall_s"]
    assert "TOTAL to first token" in capsys.readouterr().out


def test_a_remembered_config_rebuilds_to_the_same_model(tiny_model_dirs, tmp_path):
    from transformers import AutoConfig

    from hearth_llm.engine.loader.config_cache import load_config
    from hearth_llm.engine.models import model_class_for

    for name, directory in tiny_model_dirs.items():
        real = load_config(directory / "config.json", cache_root=tmp_path)  # resolved by AutoConfig, written
        cached = load_config(directory / "config.json", cache_root=tmp_path)
        assert type(real) is type(AutoConfig.from_pretrained(directory)) and type(cached) is not type(real), name
        assert (type(cached).__name__, cached.model_type) == (type(real).__name__, real.model_type)
        model_class = model_class_for(real)
        assert model_class_for(cached) is model_class
        ours, theirs = model_class.arch_from_hf_config(cached), model_class.arch_from_hf_config(real)
        for field in dataclasses.fields(theirs):
            a, b = getattr(ours, field.name), getattr(theirs, field.name)
            assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, (name, field.name)
        assert cached._name_or_path == str(directory)


def test_config_classes_with_logic_of_their_own_are_not_remembered(tmp_path):
    from transformers import LlamaConfig

    from hearth_llm.engine.loader.config_cache import is_plain_config_class, remember

    class WithProperty(LlamaConfig):
        @property
        def layers_per_stage(self):
            return self.num_hidden_layers // 2

    class WithAlias(LlamaConfig):
        attribute_map = {"n_layer": "num_hidden_layers"}

    assert is_plain_config_class(LlamaConfig)
    assert not is_plain_config_class(WithProperty) and not is_plain_config_class(WithAlias)
    assert not remember(tmp_path / "entry.json", WithProperty(num_hidden_layers=2))
    assert not (tmp_path / "entry.json").exists()


def test_top_level_tokenizers_load_as_autotokenizer_loads_them(tiny_model_dirs):
    from transformers import AutoTokenizer

    directory = tiny_model_dirs["llama"]
    direct, auto = hf_dir._load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert type(direct) is type(auto)
    assert direct.get_vocab() == auto.get_vocab() and direct.all_special_tokens == auto.all_special_tokens
    assert direct("w5 w7 w9").input_ids == auto("w5 w7 w9").input_ids
