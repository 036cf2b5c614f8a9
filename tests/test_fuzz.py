"""Fuzzing: random sampling settings and a state machine over the scheduler and block pool."""
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hearth_llm.engine import EngineConfig, LLMEngine, SamplingParams

from conftest import TINY_VOCAB

ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                      st.text(max_size=5), st.lists(st.text(max_size=3), max_size=3))
FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs",
          "prompt_logprobs"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), ANY_VALUE, max_size=4))
def test_sampling_params_accept_or_raise_value_error_naming_a_field(kwargs):
    try:
        SamplingParams(**kwargs)
    except ValueError as error:
        assert any(name in str(error) for name in FIELDS), error


@pytest.fixture(scope="module")
def small_pool_llm(tiny_model_dirs):
    # 20 blocks of 4 tokens: small enough that a handful of requests forces preemption.
    return LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama"]), block_size=4, kv_cache_memory=20 * 2048,
                                  max_model_len=64, max_num_batched_tokens=24, show_progress=False))


def check_pool_invariants(engine):
    pool = engine.kv_cache.pool
    holders = Counter(block for request in engine.scheduler.running for block in request.block_ids)
    for block in pool.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == holders.get(block.block_id, 0), (block, holders.get(block.block_id))
        assert (block.ref_count == 0) == (block.block_id in pool.free_queue)
    for request in engine.scheduler.running:
        assert len(set(request.block_ids)) == len(request.block_ids), "a request holds a block twice"
    for block_hash, block_id in pool.cached_blocks.items():
        assert pool.blocks[block_id].block_hash == block_hash
    for request in engine.scheduler.waiting:
        assert request.block_ids == []
    stats = engine.stats()
    used = sum(1 for block in pool.blocks if block.ref_count > 0)
    assert stats["num_free_blocks"] + used == stats["num_total_blocks"]


class SchedulerMachine(RuleBasedStateMachine):
    llm = None

    def __init__(self):
        super().__init__()
        self.engine = self.llm
        self.live: list[str] = []

    @rule(length=st.integers(1, 40), shared=st.booleans(), max_tokens=st.integers(1, 12),
          priority=st.integers(0, 2))
    def add(self, length, shared, max_tokens, priority):
        prompt = ([9] * 8 if shared else []) + [(5 + 7 * i + length) % TINY_VOCAB for i in range(length)]
        params = SamplingParams(temperature=0.7, seed=length, max_tokens=max_tokens, ignore_eos=True)
        self.live.append(self.engine.add_request(prompt[:60], params, priority=priority))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(self.live))
        self.engine.abort_request(request_id)

    @rule()
    def step(self):
        self.engine.step()

    @invariant()
    def pool_is_consistent(self):
        check_pool_invariants(self.engine)

    def teardown(self):
        while self.engine.has_unfinished_requests():
            self.engine.step()
        for request_id in self.live:
            self.engine.release(request_id)
        stats = self.engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_scheduler_and_block_pool_invariants(small_pool_llm):
    SchedulerMachine.llm = small_pool_llm
    runner = SchedulerMachine.TestCase()
    runner.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                               suppress_health_check=list(HealthCheck))
    runner.runTest()
    assert small_pool_llm.stats()["num_preemptions"] > 0


REQUEST_FIELDS = ("prompt", "max_tokens", "n", "logprobs", "prompt_logprobs", "max_model_len")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.one_of(st.lists(st.integers(-5, TINY_VOCAB + 5), max_size=80), st.text(max_size=20)),
       max_tokens=st.one_of(st.none(), st.integers(-2, 100)), n=st.integers(0, 70),
       logprobs=st.one_of(st.none(), st.integers(-1, 25)))
def test_requests_are_queued_whole_or_refused_naming_the_field(small_pool_llm, prompt, max_tokens, n, logprobs):
    engine = small_pool_llm
    before = engine.stats()
    try:
        params = SamplingParams(max_tokens=max_tokens, n=n, logprobs=logprobs, ignore_eos=True)
        request_id = engine.add_request(prompt, params)
    except ValueError as error:
        assert any(name in str(error) for name in REQUEST_FIELDS), error
        assert engine.stats() == before
        return
    assert engine.stats()["num_waiting"] == before["num_waiting"] + n
    engine.abort_request(request_id)
    engine.release(request_id)
    after = engine.stats()
    for field in ("num_running", "num_waiting", "num_free_blocks"):
        assert after[field] == before[field], field


MESSAGE = st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name"]),
                          st.one_of(st.none(), st.integers(), st.text(max_size=8),
                                    st.lists(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
                                             max_size=2)),
                          max_size=3)


@settings(max_examples=150, deadline=None)
@given(messages=st.one_of(st.lists(MESSAGE, max_size=4), st.text(max_size=5), st.none()))
def test_chat_messages_render_or_raise_value_error_naming_them(default_tokenizer, messages):
    from hearth_llm.engine.registry import ChatPrompt, render_chat_prompt

    try:
        text = render_chat_prompt(default_tokenizer, ChatPrompt(messages))
    except ValueError as error:
        assert "messages" in str(error), error
    else:
        assert isinstance(text, str) and text


TOOL = st.dictionaries(st.sampled_from(["name", "description", "parameters", "function", "type"]),
                       st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=6),
                                 st.dictionaries(st.sampled_from(["name", "type", "properties"]),
                                                 st.one_of(st.text(max_size=4), st.floats()), max_size=2)),
                       max_size=4)


@settings(max_examples=200, deadline=None)
@given(tools=st.lists(TOOL, min_size=1, max_size=3))
def test_tool_schemas_normalize_or_raise_value_error_naming_tools(tools):
    from hearth_llm.engine.tool_calling import normalize_tools

    try:
        normalized = normalize_tools(tools)
    except ValueError as error:
        assert str(error).startswith("tools:"), error
    else:
        assert all(isinstance(tool["function"]["parameters"], dict) for tool in normalized)


@pytest.fixture(scope="module")
def default_tokenizer(default_llm):
    return default_llm.tokenizer


# ---- malformed model files: each mutation loads or raises ValueError naming the file -------------


def mutated(data: bytes, edits: list[tuple[int, int]], limit: int) -> bytes:
    out = bytearray(data)
    for position, value in edits:
        out[position % min(limit, len(out))] = value
    return bytes(out)


BYTE_EDITS = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4)


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tmp_path_factory) -> bytes:
    from test_gguf_loader import llama_cpp_tensors, tiny_llama_state_dict, write_tiny_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", llama_cpp_tensors(tiny_llama_state_dict()))
    return path.read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=BYTE_EDITS, keep=st.one_of(st.none(), st.integers(0, 4096)))
def test_mutated_gguf_loads_or_raises_value_error_naming_the_file(tiny_gguf_bytes, edits, keep):
    import tempfile
    from pathlib import Path

    import torch

    from hearth_llm.engine.loader.gguf import load_gguf

    # the header and metadata (names, types, shapes, offsets) sit in the first few KiB
    data = mutated(tiny_gguf_bytes, edits, 4096)
    data = data if keep is None else data[:keep]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mutated.gguf"
        path.write_bytes(data)
        try:
            load_gguf(path, torch.float32, cache_dir=Path(folder) / "cache", progress=False)
        except ValueError as error:
            assert "mutated.gguf" in str(error), error


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=BYTE_EDITS, keep=st.one_of(st.none(), st.integers(0, 2048)))
def test_mutated_safetensors_loads_or_raises_value_error_naming_the_file(tiny_model_dirs, edits, keep):
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from hearth_llm.engine.loader import load_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / "model"
        shutil.copytree(tiny_model_dirs["llama"], target)
        weights = target / "model.safetensors"
        data = mutated(weights.read_bytes(), edits, 2048)  # the JSON header comes first
        weights.write_bytes(data if keep is None else data[:keep])
        try:
            load_checkpoint(str(target), torch.float32, progress=False)
        except ValueError as error:
            assert "model.safetensors" in str(error), error


JSON_VALUE = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10**9, 10**9), st.floats(allow_nan=False),
                                    st.text(max_size=6)),
                          lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6),
                                                                                          children, max_size=3),
                          max_leaves=6)
CONFIG_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
               "intermediate_size", "rope_theta", "rope_scaling", "architectures", "head_dim", "rms_norm_eps",
               "max_position_embeddings", "tie_word_embeddings", "torch_dtype"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUE, min_size=1, max_size=3))
def test_config_json_with_wrong_values_loads_or_raises_value_error(tiny_model_dirs, changes):
    import json
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from hearth_llm.engine.loader import load_checkpoint
    from hearth_llm.engine.models import model_class_for

    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / "model"
        shutil.copytree(tiny_model_dirs["llama"], target)
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, **changes}))
        try:
            checkpoint = load_checkpoint(str(target), torch.float32, progress=False)
            model_class_for(checkpoint.config).arch_from_hf_config(checkpoint.config)
        except ValueError as error:
            assert "config.json" in str(error), error
