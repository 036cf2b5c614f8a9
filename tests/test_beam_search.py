"""``LLM.beam_search`` against HF transformers ``generate(num_beams=..., do_sample=False)`` on a tiny
random Llama in float32: the same sequences, in the same order, with the same scores."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from hearth_llm.engine import BeamSearchParams

from conftest import TINY_CONFIGS, hf_model, random_prompts
from model_equality import save_tiny_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model(TINY_CONFIGS["llama"](), tmp_path_factory.mktemp("beam_llama"), seed=5)


def hf_beam_search(path, prompt: list[int], width: int, max_tokens: int, length_penalty: float, eos_token_id):
    with torch.no_grad():
        out = hf_model(str(path)).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), num_beams=width,
            num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens, length_penalty=length_penalty,
            early_stopping=False, eos_token_id=eos_token_id, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True)
    sequences = [row[len(prompt):].tolist() for row in out.sequences]
    if eos_token_id is not None:  # rows shorter than the longest are padded after their EOS
        sequences = [row[:row.index(eos_token_id) + 1] if eos_token_id in row else row for row in sequences]
    return sequences, out.sequences_scores.tolist()


@pytest.mark.parametrize("width, length_penalty", [(3, 1.0), (4, 0.5)])
def test_beam_search_matches_hf_sequences_and_scores(llama_dir, make_llm, width, length_penalty):
    llm = make_llm(llama_dir, dtype="float32")
    prompts = random_prompts(2, [5, 9], seed=width)
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=6,
                                                         length_penalty=length_penalty, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        sequences, scores = hf_beam_search(llama_dir, prompt, width, 6, length_penalty, eos_token_id=None)
        assert [sequence.token_ids for sequence in output.sequences] == sequences
        assert [sequence.score for sequence in output.sequences] == pytest.approx(scores, abs=1e-4)


def with_eos(path, tmp_path, eos: int):
    """A copy of the model whose end-of-sequence token is ``eos`` (config and tokenizer)."""
    copy = shutil.copytree(path, tmp_path / f"eos{eos}")
    for name, key, value in (("config.json", "eos_token_id", eos), ("tokenizer_config.json", "eos_token", f"w{eos}")):
        data = json.loads((copy / name).read_text())
        data[key] = value
        (copy / name).write_text(json.dumps(data))
    return copy


def test_beams_that_end_with_eos_finish_early_as_in_hf(llama_dir, tmp_path, make_llm):
    prompt = random_prompts(1, [7], seed=11)[0]
    unconstrained, _ = hf_beam_search(llama_dir, prompt, 3, 6, 1.0, eos_token_id=None)
    eos = unconstrained[0][2]  # the best beam's third token ends it
    eos_dir = with_eos(llama_dir, tmp_path, eos)
    # length_penalty=0: scores are plain log-probabilities, so a beam that ended early can win
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.0)
    [output] = make_llm(eos_dir, dtype="float32").beam_search([prompt], params)
    sequences, scores = hf_beam_search(eos_dir, prompt, 3, 6, 0.0, eos_token_id=eos)
    assert [sequence.token_ids for sequence in output.sequences] == sequences
    assert [sequence.score for sequence in output.sequences] == pytest.approx(scores, abs=1e-4)
    assert any(sequence.finish_reason == "stop" and len(sequence.token_ids) < 6 for sequence in output.sequences)


def test_beam_search_params_are_checked():
    with pytest.raises(ValueError, match=r"beam_width must be an int in \[1, 10\]"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
