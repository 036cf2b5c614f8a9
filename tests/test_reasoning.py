"""Thinking models through the chat service: a tiny random Qwen3 with a Qwen3-style chat template
(its thinking switch, a think-block budget, a grammar after the block) compared with HF
transformers greedy, and the bundled SmolLM2 made to think by a forced ``<think>`` prefix."""
from __future__ import annotations

import asyncio

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hearth_llm.engine import get_engine
from hearth_llm.engine.chat import ChatRequest, ChatService, SamplingOptions
from hearth_llm.engine.chat.service import plan_request
from hearth_llm.engine.model_info import ModelInfo

from conftest import TINY_CONFIGS, TINY_VOCAB, hf_greedy
from model_equality import save_tiny_model

QWEN3_STYLE = (
    "{% for m in messages %}<|im_start|> {{ m.content }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> w9 "
    "{% if enable_thinking is defined and enable_thinking is false %}<think> </think> {% endif %}{% endif %}")
R1_STYLE = "{% for m in messages %}w8 {{ m.content }} {% endfor %}{% if add_generation_prompt %}w9 <think> {% endif %}"
SPECIAL = {"<pad>": 0, "<s>": 1, "<|im_end|>": 2, "<unk>": 3, "<|im_start|>": 4}
THINK_TAGS = {"<think>": 5, "</think>": 6}
QUESTION = [{"role": "user", "content": "w20 w21 w22"}]
CLOSE = [6]  # "\n</think>\n\n" in this vocabulary (the word-level pre-tokenizer drops the newlines)


def thinking_tokenizer(chat_template: str) -> PreTrainedTokenizerFast:
    """Words w7…w319, the ChatML specials, and <think>/</think> as plain added tokens, as in Qwen3."""
    vocab = {**SPECIAL, **THINK_TAGS, **{f"w{i}": i for i in range(7, TINY_VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL])
    backend.add_tokens([AddedToken(token, special=False) for token in THINK_TAGS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def thinking_models(tmp_path_factory):
    """Two tiny Qwen3s, one per template; the engines are closed after the module."""
    dirs, cores = {}, []
    for name, template in (("qwen3", QWEN3_STYLE), ("r1", R1_STYLE)):
        path = save_tiny_model(TINY_CONFIGS["qwen3"](), tmp_path_factory.mktemp(name), seed=3)
        thinking_tokenizer(template).save_pretrained(path)
        core = get_engine(str(path), show_progress=False, max_model_len=256)
        dirs[name] = (path, ChatService(core))
        cores.append(core)
    yield dirs
    for core in cores:
        core.close()


def greedy(max_tokens: int) -> SamplingOptions:
    return SamplingOptions(temperature=0, max_tokens=max_tokens)


def decode(path, token_ids: list[int]) -> str:
    return thinking_tokenizer(QWEN3_STYLE).decode(token_ids)


def test_reasoning_maps_to_the_templates_switch(thinking_models):
    _, service = thinking_models["qwen3"]
    info = service.core.model_info
    on = plan_request(ChatRequest(QUESTION, reasoning=True), info)
    off = plan_request(ChatRequest(QUESTION, reasoning=False), info)
    default = plan_request(ChatRequest(QUESTION), info)
    assert on.prompt.chat_template_kwargs == {"enable_thinking": True}
    assert off.prompt.chat_template_kwargs == {"enable_thinking": False}
    assert default.prompt.chat_template_kwargs is None and default.reasoning_parser.name == "think"
    kept = plan_request(ChatRequest(QUESTION, reasoning=True, chat_template_kwargs={"enable_thinking": False}), info)
    assert kept.prompt.chat_template_kwargs == {"enable_thinking": False}  # the caller's own entry wins


def test_reasoning_off_renders_the_empty_block_and_the_answer_is_content(thinking_models):
    path, service = thinking_models["qwen3"]
    result = service.chat(ChatRequest(QUESTION, reasoning=False, sampling=greedy(6)))
    assert result.prompt.endswith("<think> </think> ")
    prompt_ids = service.core.tokenizer.encode(result.prompt)
    assert result.content == decode(path, hf_greedy(path, prompt_ids, 6)) and result.reasoning == ""


def test_a_budget_closes_the_think_block_and_the_answer_continues_like_hf(thinking_models):
    path, service = thinking_models["qwen3"]
    request = ChatRequest(QUESTION, reasoning=True, max_reasoning_tokens=3, sampling=greedy(9))
    result = service.chat(request)
    prompt_ids = service.core.tokenizer.encode(result.prompt)
    assert result.prompt.endswith("w9 <think>\n")  # the template leaves opening the block to the model
    thinking = hf_greedy(path, prompt_ids, 3)
    answer = hf_greedy(path, prompt_ids + thinking + CLOSE, 9 - 3 - len(CLOSE))
    assert result.reasoning == decode(path, thinking)
    assert result.content == decode(path, answer)
    assert result.usage.reasoning_tokens == 3 and result.usage.completion_tokens == 9
    assert result.finish_reason == "length"
    deltas = list(service.stream(request))
    assert "".join(d.reasoning for d in deltas) == result.reasoning
    assert "".join(d.content for d in deltas) == result.content
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert not any(d.reasoning for d in deltas[first_content:]), "reasoning chunks come first"


def test_a_grammar_constrains_only_the_answer_after_the_think_block(thinking_models):
    # "w8": no other word is a prefix of it, so the word-level vocabulary can always finish it
    path, service = thinking_models["qwen3"]
    result = service.chat(ChatRequest(QUESTION, max_reasoning_tokens=4, structured_output={"choice": ["w8"]},
                                      sampling=greedy(12)))
    prompt_ids = service.core.tokenizer.encode(result.prompt)
    assert result.reasoning == decode(path, hf_greedy(path, prompt_ids, 4))  # unconstrained thinking
    assert result.content == "w8" and result.finish_reason == "stop"
    assert result.usage.reasoning_tokens == 4


def test_a_template_that_opens_the_block_makes_the_whole_output_reasoning(thinking_models):
    path, service = thinking_models["r1"]
    result = service.chat(ChatRequest(QUESTION, sampling=greedy(5)))  # the format is read when output arrives
    prompt_ids = service.core.tokenizer.encode(result.prompt)
    assert result.reasoning == decode(path, hf_greedy(path, prompt_ids, 5))
    assert result.content == "" and result.usage.reasoning_tokens == 5
    budgeted = service.chat(ChatRequest(QUESTION, max_reasoning_tokens=2, sampling=greedy(5)))
    assert budgeted.prompt == result.prompt  # already open: nothing appended
    assert budgeted.reasoning == decode(path, hf_greedy(path, prompt_ids, 2))
    assert budgeted.content == decode(path, hf_greedy(path, prompt_ids + hf_greedy(path, prompt_ids, 2) + CLOSE, 2))


def test_async_chat_and_stream_split_like_the_sync_ones(thinking_models):
    _, service = thinking_models["qwen3"]
    request = ChatRequest(QUESTION, reasoning=True, max_reasoning_tokens=3, sampling=greedy(7))
    expected = service.chat(request)

    async def run():
        whole = await service.achat(request)
        deltas = [delta async for delta in await service.astream(request)]
        return whole, deltas

    whole, deltas = asyncio.run(run())
    assert (whole.reasoning, whole.content, whole.usage) == (expected.reasoning, expected.content, expected.usage)
    assert "".join(d.reasoning for d in deltas) == expected.reasoning
    assert "".join(d.content for d in deltas) == expected.content


def test_budget_with_n_above_one_is_refused(thinking_models):
    _, service = thinking_models["qwen3"]
    with pytest.raises(ValueError, match="n=2"):
        service.chat(ChatRequest(QUESTION, max_reasoning_tokens=2, sampling=SamplingOptions(n=2, max_tokens=4)))


def test_reasoning_or_a_budget_on_a_model_that_does_not_think_is_refused():
    info = ModelInfo("m", "LlamaForCausalLM", "llama", 64, 100, "{{ messages }}", frozenset({2}))
    with pytest.raises(ValueError, match="reasoning=True.*reasoning_parser"):
        plan_request(ChatRequest(QUESTION, reasoning=True), info)
    with pytest.raises(ValueError, match="max_reasoning_tokens.*reasoning_parser"):
        plan_request(ChatRequest(QUESTION, max_reasoning_tokens=8), info)
    assert plan_request(ChatRequest(QUESTION), info).reasoning_parser is None  # not thinking: nothing to split


# ---- the bundled SmolLM2, made to think by a forced <think> prefix --------------------------------

FORCED = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n<think>\n"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def smollm2_service(default_llm):
    return ChatService(get_engine("default", dtype="float32", show_progress=False))  # default_llm's engine


def test_a_forced_think_prefix_is_reasoning_and_the_budget_hands_over_to_the_answer(default_llm, smollm2_service):
    from hearth_llm.engine import SamplingParams

    request = ChatRequest(FORCED, reasoning_parser="think", max_reasoning_tokens=4, sampling=greedy(12))
    result = smollm2_service.chat(request)
    [thinking] = default_llm.generate(FORCED, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    thinking = thinking.outputs[0]
    close = default_llm.tokenizer.encode("\n</think>\n\n", add_special_tokens=False)
    prompt_ids = default_llm.tokenizer.encode(FORCED)
    [answer] = default_llm.generate([prompt_ids + thinking.token_ids + close],
                                    SamplingParams(temperature=0, max_tokens=12 - 4 - len(close)), use_tqdm=False)
    assert result.reasoning == thinking.text.strip() and result.usage.reasoning_tokens == 4
    assert result.content == answer.outputs[0].text.lstrip() and result.content
    assert result.text == thinking.text + "\n</think>\n\n" + answer.outputs[0].text
    assert result.usage.completion_tokens == 4 + len(close) + len(answer.outputs[0].token_ids)
    deltas = list(smollm2_service.stream(request))
    assert ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)) == (result.reasoning,
                                                                                        result.content)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert any(d.reasoning for d in deltas[:first_content]) and not any(d.reasoning for d in deltas[first_content:])


def test_a_forced_tool_call_comes_after_the_think_block_and_thinking_is_not_parsed_for_calls(smollm2_service):
    result = smollm2_service.chat(ChatRequest(
        [{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER], tool_choice="required",
        reasoning_parser="think", max_reasoning_tokens=3, sampling=greedy(40)))
    assert result.prompt.endswith("<|im_start|>assistant\n<think>\n")  # SmolLM2 does not open it: we did
    assert result.reasoning and result.usage.reasoning_tokens == 3
    [call] = result.tool_calls
    assert call.name == "get_weather" and isinstance(call.arguments["city"], str)
    assert result.text.index("</think>") < result.text.index("<tool_call>")
