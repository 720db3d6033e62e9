"""Constrained decoding on the real SmolLM2-135M-Instruct checkpoint (greedy, CPU): every
grammar kind yields output that parses and validates, in one batch with a free request
whose tokens are exactly those of its run alone."""
from __future__ import annotations

import json
import re

import pytest
from tokenizers import Tokenizer

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
from services.executor.engine.sequence import FinishReason
from weft.models.sources import resolve_model

MAX_STEPS = 200
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 20},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "city", "role"],
}
WEATHER_CALL = {
    "type": "structural_tag",
    "format": {"type": "tag", "begin": "<tool_call>", "end": "</tool_call>", "content": {
        "type": "json_schema", "json_schema": {
            "type": "object",
            "properties": {"name": {"const": "get_weather"},
                           "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                         "required": ["city"]}},
            "required": ["name", "arguments"]}}},
}
REQUESTS = {
    "schema": ("Describe Alice, a 30 year old admin living in Paris, as JSON.", GrammarSpec("json_schema", json.dumps(PERSON))),
    "object": ("Give me a JSON object with a name and an age.", GrammarSpec("json_object")),
    "regex": ("Give me a code like 123-abc.", GrammarSpec("regex", "[0-9]{3}-[a-z]+")),
    "ebnf": ("Is Paris in France? Answer yes or no.", GrammarSpec("ebnf", 'root ::= "yes" | "no"')),
    "tag": ("What is the weather in Paris? Call the get_weather tool.", GrammarSpec("structural_tag", json.dumps(WEATHER_CALL))),
    "free": ("Give me a code like 123-abc.", None),
}


@pytest.fixture(scope="module")
def smollm2():
    model_dir = resolve_model("smollm2-135m-instruct", progress=False)
    return LLMEngine(model_dir, EngineConfig(num_kv_blocks=256)), Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _chat(tokenizer: Tokenizer, message: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                            f"Face<|im_end|>\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n").ids


def _run(engine: LLMEngine, tokenizer: Tokenizer, names) -> dict[str, tuple[str, FinishReason, list[int]]]:
    for name in names:
        message, grammar = REQUESTS[name]
        engine.add_request(name, _chat(tokenizer, message), SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar))
    tokens: dict[str, list[int]] = {name: [] for name in names}
    done: dict[str, FinishReason] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out.finish_reason
    return {n: (tokenizer.decode(tokens[n], skip_special_tokens=True), done[n], tokens[n]) for n in names}


def _person_errors(doc: object) -> list[str]:
    """A hand validator of PERSON (jsonschema is not a dependency)."""
    if not isinstance(doc, dict):
        return ["not an object"]
    errors = [f"extra key {k}" for k in doc if k not in PERSON["properties"]]
    errors += [f"missing {k}" for k in PERSON["required"] if k not in doc]
    types = {"name": str, "age": int, "city": str}
    errors += [f"{k} is {type(doc[k]).__name__}" for k, t in types.items()
               if k in doc and (not isinstance(doc[k], t) or isinstance(doc[k], bool))]
    errors += [f"{k} too long" for k in ("name", "city") if isinstance(doc.get(k), str) and len(doc[k]) > 20]
    if doc.get("role") not in ("admin", "user"):
        errors.append(f"role {doc.get('role')!r}")
    return errors


@pytest.fixture(scope="module")
def outputs(smollm2):
    return _run(*smollm2, list(REQUESTS))


def test_json_schema_output_parses_and_validates(outputs):
    text, reason, _ = outputs["schema"]
    assert reason is FinishReason.STOP
    doc = json.loads(text)
    assert _person_errors(doc) == [], text
    assert doc["name"] == "Alice" and doc["age"] == 30  # the model followed the prompt inside the schema


def test_json_object_output_is_one_json_object(outputs):
    text, reason, _ = outputs["object"]
    assert reason is FinishReason.STOP and isinstance(json.loads(text), dict)


def test_regex_output_matches_even_when_cut_at_max_tokens(outputs):
    text, reason, _ = outputs["regex"]
    assert reason in (FinishReason.STOP, FinishReason.LENGTH)  # [a-z]+ lets a greedy model spell on
    assert re.fullmatch("[0-9]{3}-[a-z]+", text), text


def test_ebnf_output_is_one_of_its_words(outputs):
    text, reason, _ = outputs["ebnf"]
    assert reason is FinishReason.STOP and text in ("yes", "no")


def test_structural_tag_output_is_the_tagged_tool_call(outputs):
    text, reason, _ = outputs["tag"]
    assert reason is FinishReason.STOP
    match = re.fullmatch(r"<tool_call>(.*)</tool_call>", text, re.DOTALL)
    assert match, text
    call = json.loads(match.group(1))
    assert call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str)


def test_the_free_request_in_the_batch_gets_its_unconstrained_tokens(smollm2, outputs):
    engine, tokenizer = smollm2
    alone = _run(engine, tokenizer, ["free"])["free"]
    assert outputs["free"] == alone
    assert not re.fullmatch("[0-9]{3}-[a-z]+", alone[0])  # it is free: the regex row's mask did not reach it
