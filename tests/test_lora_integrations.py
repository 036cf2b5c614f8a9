"""LoRA adapters per call through the public surfaces: AsyncLLM, LangChain's ChatHearth (field and
``.bind``), LlamaIndex's HearthLLM; each answer equal to LLM's with the same adapter and named in
the response metadata."""
from __future__ import annotations

import asyncio

import pytest
from transformers import LlamaConfig

from hearth_llm.engine import LLM, AsyncLLM, LoRARequest, SamplingParams

from conftest import TINY_COMMON, random_prompts, tiny_tokenizer
from model_equality import save_tiny_model
from test_lora import make_adapter

pytest.importorskip("peft")

ENGINE_KWARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8, show_progress=False)
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_integrations")
    base = save_tiny_model(LlamaConfig(**TINY_COMMON, architectures=["LlamaForCausalLM"]), root / "base", seed=4)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} w9 {% endfor %}"
    tokenizer.save_pretrained(base)
    adapters = [make_adapter(base, root / name, seed=seed) for name, seed in (("x", 7), ("y", 8))]
    llm = LLM(str(base), **ENGINE_KWARGS)  # the integrations below share this engine (same model and config)
    yield llm, str(base), adapters
    llm.close()


def _chat_text(llm, adapter, text="w5 w6 w7") -> str:
    """LLM.chat's answer with ``adapter`` (named by its path, as the integrations name it)."""
    lora = None if adapter is None else LoRARequest(adapter, adapter)
    [out] = llm.chat([{"role": "user", "content": text}], SamplingParams(temperature=0, max_tokens=6),
                     use_tqdm=False, lora_request=lora)
    return out.outputs[0].text


def test_async_llm_generate_with_an_adapter(served):
    llm, base, (x, _) = served
    prompt = random_prompts(1, [10], seed=31)[0]
    [expected] = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=LoRARequest("x", x))

    async def run():
        with AsyncLLM(base, **ENGINE_KWARGS) as engine:
            return [out async for out in engine.generate(prompt, PARAMS, lora_request=LoRARequest("x"))]
    outputs = asyncio.run(run())
    assert [t for out in outputs for t in out.delta_token_ids] == expected.outputs[0].token_ids
    assert outputs[-1].lora_name == "x"


def test_chat_hearth_lora_field_and_bind(served):
    chat_models = pytest.importorskip("hearth_llm.integrations.langchain.chat_models")
    llm, base, (x, y) = served
    chat = chat_models.ChatHearth(model=base, lora=x, temperature=0, max_tokens=6, engine_kwargs=ENGINE_KWARGS)
    answer = chat.invoke("w5 w6 w7")
    assert answer.content == _chat_text(llm, x) and answer.response_metadata["lora_name"] == x
    other = chat.bind(lora=y).invoke("w5 w6 w7")
    assert other.content == _chat_text(llm, y) and other.response_metadata["lora_name"] == y
    assert len({_chat_text(llm, x), _chat_text(llm, y), _chat_text(llm, None)}) == 3


def test_llama_index_hearth_llm_lora(served):
    llama_index_llm = pytest.importorskip("hearth_llm.integrations.llama_index.llm")
    llm, base, (x, _) = served
    hearth = llama_index_llm.HearthLLM(model=base, lora=x, temperature=0, max_tokens=6, engine_kwargs=ENGINE_KWARGS)
    from llama_index.core.llms import ChatMessage

    response = hearth.chat([ChatMessage(role="user", content="w5 w6 w7")])
    assert response.message.content == _chat_text(llm, x) and response.raw["lora_name"] == x
    base_response = hearth.chat([ChatMessage(role="user", content="w5 w6 w7")], lora=None)
    assert base_response.message.content == _chat_text(llm, None) and "lora_name" not in base_response.raw
