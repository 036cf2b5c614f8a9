"""The bundled SmolLM2-135M-Instruct: HF-equal greedy decoding, GGUF vs HF-dir loading, streaming text."""
import pytest
import torch
from transformers import LlamaForCausalLM

from hearth_llm.engine import LLM, SamplingParams
from hearth_llm.engine.detokenizer import IncrementalDetokenizer
from hearth_llm.engine.loader import load_checkpoint

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain gravity to a child."]
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_hf_dir(tmp_path_factory):
    """The GGUF's weights, dequantized by the gguf package, as an HF model and an HF directory."""
    checkpoint = load_checkpoint("default", torch.float32, progress=False)
    model = LlamaForCausalLM(checkpoint.config).eval()
    missing, unexpected = model.load_state_dict(checkpoint.state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    path = tmp_path_factory.mktemp("smollm2_hf")
    model.save_pretrained(path)
    checkpoint.tokenizer.save_pretrained(path)
    return model, path


def chat_prompt_ids(tokenizer, question):
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_first_32_tokens_match_hf_alone_and_batched(smollm2, smollm2_hf_dir):
    model, _ = smollm2_hf_dir
    prompts = [chat_prompt_ids(smollm2.tokenizer, q) for q in QUESTIONS]
    references = []
    for prompt in prompts:
        with torch.no_grad():
            # An explicit mask: the prompt contains <|im_end|>, which is also the pad token.
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=2)
        references.append(out[0, len(prompt):].tolist())
    alone = smollm2.generate([prompts[0]], GREEDY_32, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == references[0]
    batched = smollm2.generate(prompts, GREEDY_32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == references


def test_gguf_and_hf_dir_of_the_same_weights_give_the_same_tokens(smollm2, smollm2_hf_dir, make_llm):
    _, path = smollm2_hf_dir
    from_dir = make_llm(path)
    prompts = [chat_prompt_ids(smollm2.tokenizer, q) for q in QUESTIONS[:2]]
    from_gguf = smollm2.generate(prompts, GREEDY_32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in from_dir.generate(prompts, GREEDY_32, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in from_gguf]


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキストです", "emoji 🙂🎉 end", "mixed ñ日🙂x"])
def test_streamed_text_has_no_replacement_characters(smollm2, text):
    tokenizer = smollm2.tokenizer
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = []
    for token_id in token_ids:
        detokenizer.add_token(token_id)
        pieces.append(detokenizer.take_stream_delta())
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text == tokenizer.decode(token_ids)


def test_stream_holds_back_a_possible_stop_string(smollm2):
    tokenizer = smollm2.tokenizer
    detokenizer = IncrementalDetokenizer(tokenizer, stop_strings=("STOP!",))
    streamed = ""
    for token_id in tokenizer.encode("abc STO", add_special_tokens=False):
        detokenizer.add_token(token_id)
        streamed += detokenizer.take_stream_delta()
    assert streamed == "abc "  # " STO" might still become the stop string
    assert detokenizer.take_stream_delta(is_final=True) == "STO"


def test_chat_uses_the_models_template(smollm2):
    out = smollm2.chat([[{"role": "user", "content": "What is the capital of France?"}]] * 2,
                       SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    rendered = out[0].prompt
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert out[1].num_cached_tokens > 0  # the second identical conversation hits the prefix cache
