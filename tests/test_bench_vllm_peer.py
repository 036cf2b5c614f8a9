"""``bench throughput --vllm``: vLLM's side runs in a subprocess on the very requests and options ours
runs (checked through a stand-in ``vllm`` package that records what it is given), an interpreter
without vLLM gets a message saying what to pass, and the ratio table reads > 1 as ours faster."""
import json
import sys
import textwrap

import pytest

from hearth_llm.benchmarks import throughput, workloads
from hearth_llm.benchmarks.shapes import config_json, shape_fields
from hearth_llm.benchmarks.vllm_peer import format_ratio_table, ratio, vllm_environment, vllm_unavailable
from hearth_llm.engine.llm_engine import LLMEngine

SMALL = ["--shape", "tiny-qwen3", "--device", "cpu", "--no-hf", "--num-seqs", "3", "--lengths", "8", "12",
         "--kv-cache-memory", "16MiB", "--prefix-burst", "4", "32", "4", "--long-context", "2", "64", "3"]

FAKE_VLLM = '''
"""A stand-in for vLLM: records each prompt and its max_tokens, returns max_tokens zeros."""
import json, os
__version__ = "0.0-stand-in"

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos, detokenize):
        assert temperature == 0 and ignore_eos and not detokenize
        self.max_tokens = max_tokens

class _Out:
    def __init__(self, count):
        self.outputs = [type("Completion", (), {"token_ids": [0] * count})()]

class LLM:
    def __init__(self, model, **options):
        with open(os.path.join(model, "config.json")) as source:
            self._log({"options": options, "config": json.load(source)})

    def generate(self, prompts, params, use_tqdm):
        for prompt, param in zip(prompts, params):
            self._log({"prompt": prompt["prompt_token_ids"], "max_tokens": param.max_tokens})
        return [_Out(param.max_tokens) for param in params]

    def _log(self, record):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as sink:
            sink.write(json.dumps(record) + "\\n")
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    log = tmp_path / "vllm_log.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return tmp_path / "site", log


def test_an_interpreter_without_vllm_is_told_what_to_pass(capsys, tmp_path):
    assert vllm_unavailable(sys.executable, vllm_environment(str(tmp_path))) is not None
    with pytest.raises(SystemExit) as exit_info:
        throughput.main([*SMALL, "--vllm", "--skip-ours", "--vllm-python", sys.executable])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "cannot import: vllm" in error and "--vllm-pythonpath" in error


def test_vllms_side_gets_the_same_requests_and_options_as_ours(fake_vllm, monkeypatch, tmp_path, capsys):
    site, log = fake_vllm
    ours = []
    original_add = LLMEngine.add_request

    def add_request(self, prompt, sampling_params=None, *args, **kwargs):
        ours.append({"prompt": list(prompt), "max_tokens": sampling_params.max_tokens})
        return original_add(self, prompt, sampling_params, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    out = tmp_path / "both.json"
    throughput.main([*SMALL, "--workloads", "throughput", "burst", "long", "--vllm", "--vllm-pythonpath", str(site),
                     "--json", str(out)])
    records = [json.loads(line) for line in log.read_text().splitlines()]
    setup, peer = records[0], records[1:]
    assert setup["options"]["max_num_seqs"] == 256 and setup["options"]["max_num_batched_tokens"] == 16384
    assert setup["options"]["max_model_len"] == 4096  # the long mix (64 + 3 tokens) fits the default
    assert setup["config"]["num_hidden_layers"] == 2 and setup["config"]["model_type"] == "qwen3"
    warmup = [{"prompt": prompt, "max_tokens": 4} for batch in workloads.warmup_batches(8, 12) for prompt in batch]
    assert peer[:len(warmup)] == warmup
    # Ours also warms up twice and times bs1 its older way (prompts of 16 and 32 ids) after the throughput run.
    extra = [record for record in ours if record in warmup or record["prompt"] in (list(range(16)), list(range(100, 132)))]
    assert len(extra) == 2 * len(warmup) + 2
    timed = [record for record in ours if record not in extra]
    assert timed == peer[len(warmup):]  # the throughput run, both bursts with the primer, the long mix
    assert len(timed) == 3 + (4 + 1 + 4) + 2
    result = json.loads(out.read_text())
    assert set(result["vllm"]["measures"]) == set(result["measures"])
    table = capsys.readouterr().out
    assert "shared-prefix burst, never seen" in table and "long-context mix" in table


def test_ratios_read_above_one_when_ours_is_faster():
    assert ratio("throughput_tok_s", 12.0, 10.0) == pytest.approx(1.2)
    assert ratio("long_context_s", 10.0, 11.0) == pytest.approx(1.1)
    table = format_ratio_table({"throughput_tok_s": 9.0, "prefix_burst_cold_s": 1.0, "bs1_ms_per_token": 4.0},
                               {"throughput_tok_s": 10.0, "prefix_burst_cold_s": 2.0, "bs1_ms_per_token": 5.0},
                               "llama3-8b")
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert "0.90x" in rows["throughput (256 seqs), tok/s"] and "NOT met" in rows["throughput (256 seqs), tok/s"]
    assert "2.00x" in rows["shared-prefix burst, never seen, s"] and "met" in rows["shared-prefix burst, never seen, s"]
    assert "1.25x" in rows["bs1 decode, ms/token"]
    assert table.splitlines()[-1] == "bs1 decode goal <= 4.15 ms/token: 4.000 met"


def test_the_workloads_have_their_stated_shapes():
    burst = workloads.prefix_burst()
    assert len(burst["cold"]) == len(burst["warm"]) == 64
    assert {len(prompt) for prompt in burst["cold"] + burst["warm"] + [burst["primer"]]} == {2048 + 64}
    assert len({tuple(prompt[:2048]) for prompt in burst["cold"]}) == 1
    assert burst["cold"][0][:2048] != burst["warm"][0][:2048] and burst["primer"] not in burst["warm"]
    long = workloads.long_context()
    assert len(long) == 32 and {(len(prompt), count) for prompt, count in long} == {(8192, 512)}
    assert workloads.max_model_len_for(workloads.LONG_CONTEXT) == 8704
    assert workloads.workload(5) == workloads.workload(5) and workloads.prefix_burst() == burst


def test_both_sides_build_the_long_context_shape_alike():
    assert shape_fields("llama3-8b", 8704)["max_position_embeddings"] == 8704
    assert shape_fields("qwen3-0.6b", 8704)["max_position_embeddings"] == 40960
    assert throughput.hf_config("llama3-8b", max_model_len=8704).max_position_embeddings == 8704
    written = config_json("llama3-8b", 8704)
    assert written["architectures"] == ["LlamaForCausalLM"] and written["model_type"] == "llama"
    assert written["max_position_embeddings"] == 8704 and "architecture" not in written
