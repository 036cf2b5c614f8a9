"""Guided decoding: outputs match their schema, regex, choice or grammar; bad specs fail alone."""
import json
import re

import jsonschema
import pytest

from hearth_llm.engine import SamplingParams
from hearth_llm.engine.structured_output import StructuredOutput

# Free-text strings carry a maxLength: greedy, a 135M model can loop inside an unbounded string.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["score"]},
    {"type": "object", "properties": {"count": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["count"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                                  "required": ["city", "zip"]}}, "required": ["address"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}, "note": {"type": "string", "maxLength": 16}},
     "required": ["title"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 16}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}, "maxItems": 2}},
     "required": ["items"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "maximum": 1000}, {"type": "string", "maxLength": 10}]}}, "required": ["value"]},
    {"type": "object", "properties": {"level": {"type": "string", "enum": ["low", "mid", "high"]},
                                      "weight": {"type": "number"}}, "required": ["level", "weight"]},
    {"type": "object", "properties": {"nullable": {"type": ["string", "null"]}}, "required": ["nullable"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                                            "maxItems": 2}, "maxItems": 2}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"first": {"type": "string", "maxLength": 16}, "last": {"type": "string", "maxLength": 16},
                                      "middle": {"type": "string", "maxLength": 16}}, "required": ["first", "last"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"answer": {"const": "yes"}}, "required": ["answer"]},
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "maxItems": 4}}, "required": ["ids"]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"source": {"type": "string", "maxLength": 16},
                                                                             "page": {"type": "integer"}},
                                               "required": ["source"]}, "summary": {"type": "string", "maxLength": 40}},
     "required": ["meta", "summary"]},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 3,
                                                                             "maximum": 4}}, "required": ["kind", "legs"]},
    {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
]


def ask(smollm2, question, spec, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=96, structured_output=spec, **kwargs)
    return smollm2.chat([[{"role": "user", "content": question}]], params, use_tqdm=False)[0].outputs


def test_outputs_validate_against_twenty_schemas(smollm2):
    conversations = [[{"role": "user", "content": f"Reply with a short JSON value for this schema: {json.dumps(schema)}"}]
                     for schema in SCHEMAS]
    params = [SamplingParams(temperature=0, max_tokens=160, structured_output={"json": schema}) for schema in SCHEMAS]
    outputs = smollm2.chat(conversations, params, use_tqdm=False)
    failures = []
    for schema, output in zip(SCHEMAS, outputs):
        completion = output.outputs[0]
        try:
            assert completion.finish_reason == "stop", completion.finish_reason
            jsonschema.validate(json.loads(completion.text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as error:
            failures.append((schema, completion.text[:80], str(error)[:80]))
    assert not failures, failures


def test_any_json_object(smollm2):
    text = ask(smollm2, 'Repeat exactly: {"cat": "Tom", "age": 3}', {"json_object": True})[0].text
    assert isinstance(json.loads(text), dict)


def test_regex_output_fully_matches(smollm2):
    pattern = r"[0-9]{3}-[0-9]{4}"
    text = ask(smollm2, "Give me a phone number.", {"regex": pattern})[0].text
    assert re.fullmatch(pattern, text)


def test_choice_output_is_one_of_the_options(smollm2):
    text = ask(smollm2, "Is the sky blue?", {"choice": ["yes", "no", "maybe"]})[0].text
    assert text in {"yes", "no", "maybe"}


def test_ebnf_grammar(smollm2):
    grammar = 'root ::= "The answer is " ("red" | "blue") "."'
    text = ask(smollm2, "Pick a color.", {"grammar": grammar})[0].text
    assert text in {"The answer is red.", "The answer is blue."}


def test_guided_decoding_with_n_samples_and_stop_strings(smollm2):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "w": {"type": "string", "maxLength": 16}}, "required": ["n", "w"]}
    outputs = ask(smollm2, "Numbers please.", {"json": schema}, n=3, seed=3)
    outputs_sampled = smollm2.chat([[{"role": "user", "content": "Numbers."}]], SamplingParams(
        temperature=0.7, seed=1, n=3, max_tokens=64, structured_output={"json": schema}), use_tqdm=False)[0].outputs
    for output in list(outputs) + list(outputs_sampled):
        jsonschema.validate(json.loads(output.text), schema)
    cut = ask(smollm2, "Numbers please.", {"json": schema}, stop=['"w"'])[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == '"w"'


def test_guided_decoding_survives_preemption(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], block_size=4, kv_cache_memory=12 * 2048, max_model_len=48)
    # The tiny tokenizer's tokens are "w0".."w319" (no decoder, so no spaces between them).
    spec = {"regex": "(w5|w6)+"}
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=20, min_tokens=20, structured_output=spec)
    outs = llm.generate([[7 + i] * 20 for i in range(4)], params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason in ("length", "stop")
        assert set(completion.token_ids) <= {5, 6, 2}  # w5, w6, or EOS once the regex may end


@pytest.mark.parametrize("spec, match", [
    ({"json": "{not json"}, "structured_output.json"), ({"regex": "("}, "structured_output.regex"),
    ({"choice": []}, "structured_output.choice"), ({}, "exactly one"), ({"json": {"a": 1}, "regex": "x"}, "exactly one"),
    ({"json": {"type": "object", "description": "x" * 70000}}, "too large"), ({"colour": 1}, "structured_output"),
])
def test_bad_specs_are_refused_up_front(spec, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_output=spec)


def test_an_uncompilable_grammar_fails_only_its_request(smollm2):
    good = SamplingParams(temperature=0, max_tokens=8)
    bad = SamplingParams(temperature=0, max_tokens=8, structured_output=StructuredOutput(grammar="root ::= undefined_rule"))
    outs = smollm2.generate(["Hello there", "Hi"], [good, bad], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length" and outs[0].outputs[0].text
    assert outs[1].outputs[0].finish_reason == "abort"
    assert "grammar" in str(outs[1].outputs[0].stop_reason).lower() or "structured_output" in str(outs[1].outputs[0].stop_reason)
