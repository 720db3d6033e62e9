"""JSON strings under constrained decoding stay JSON (services/executor/grammar/json_strings.py):
xgrammar 0.2.9 lets raw control characters into a length-bounded string and writes what a
pattern names unescaped. Real xgrammar over SmolLM2's tokenizer; the tiny random model for
generation."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
from services.executor.errors import InvalidRequestError
from services.executor.grammar import GrammarCache, load_tokenizer_info
from services.executor.model.config import ModelConfig
from weft.models.sources import resolve_model
from weft.testing.tiny_model import make_tiny_checkpoint

CITY = {"type": "object", "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["city"]}


@pytest.fixture(scope="module")
def cache():
    model_dir = resolve_model("smollm2-135m-instruct", progress=False)
    config = ModelConfig.from_dir(model_dir)
    c = GrammarCache(load_tokenizer_info(model_dir, config.vocab_size, config.eos_token_ids))
    yield c
    c.close()


def _accepts(cache: GrammarCache, kind: str, doc: dict, text: str) -> bool:
    matcher = xgr.GrammarMatcher(cache.get(GrammarSpec(kind, json.dumps(doc))))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("raw", ["\x04", "\t", "\x00", "\x1f"])
def test_a_raw_control_character_in_a_length_bounded_string_is_rejected(cache, raw):
    assert not _accepts(cache, "json_schema", CITY, f'{{"city": "a{raw}b"}}')


@pytest.mark.parametrize("value, ok", [("ab", True), ("abcd", True), ("a", False), ("abcde", False),
                                       ("a\\nb", True), ('\\"\\\\', True), ("\\u00e9\\t", True),
                                       ("\\u00e", False), ("a\\qb", False), ('a"b', False)])
def test_lengths_hold_and_an_escape_counts_as_one_character(cache, value, ok):
    text = f'{{"city": "{value}"}}'
    assert _accepts(cache, "json_schema", CITY, text) is ok
    if ok:
        assert 2 <= len(json.loads(text)["city"]) <= 4


def test_length_bounded_property_names_and_structural_tag_schemas_are_safe_too(cache):
    names = {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "integer"}}
    assert not _accepts(cache, "json_schema", names, '{"x\tz": 1}')
    assert _accepts(cache, "json_schema", names, '{"x\\tz": 1}')
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<t>", "end": "</t>",
                                                "content": {"type": "json_schema", "json_schema": CITY}}}
    assert not _accepts(cache, "structural_tag", tag, '<t>{"city": "a\x04b"}</t>')
    assert _accepts(cache, "structural_tag", tag, '<t>{"city": "a\\nb"}</t>')


@pytest.mark.parametrize("pattern", [".+", "[^\\n]+", "[^\"\\\\]+", "[ -~]+", "\\S+", "[a-z]{1,3}"])
def test_patterns_that_name_no_escaped_character_compile_and_keep_raw_controls_out(cache, pattern):
    doc = {"type": "string", "pattern": pattern}
    assert not _accepts(cache, "json_schema", doc, '"a\tb"')
    assert _accepts(cache, "json_schema", doc, '"abc"')


@pytest.mark.parametrize("pattern, named", [("\\t", "\\t"), ("[\\x00-\\x1f]+", "U+0000"), ("a\\u0004", "U+0004"),
                                            ('"', "a quote"), ("\\\\d", "a backslash"), ("[\\b]", "\\b")])
def test_a_pattern_naming_a_character_json_must_escape_is_refused_with_its_path(cache, pattern, named):
    doc = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}}
    with pytest.raises(InvalidRequestError) as e:
        cache.get(GrammarSpec("json_schema", json.dumps(doc)))
    assert e.value.field == "grammar.json_schema"
    assert "properties.code.pattern" in str(e.value) and named in str(e.value)


def test_a_pattern_properties_key_and_a_structural_tag_schema_pattern_are_checked(cache):
    keys = {"type": "object", "patternProperties": {"^\t$": {"type": "integer"}}}
    with pytest.raises(InvalidRequestError) as e:
        cache.get(GrammarSpec("json_schema", json.dumps(keys)))
    assert "patternProperties['^\\t$'] names control character U+0009" in str(e.value)
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<t>", "end": "</t>", "content": {
        "type": "json_schema", "json_schema": {"type": "string", "pattern": "\\x04"}}}}
    with pytest.raises(InvalidRequestError, match="format.content.json_schema.pattern"):
        cache.get(GrammarSpec("structural_tag", json.dumps(tag)))


@pytest.mark.parametrize("extra, beside", [({"pattern": "[a-z]+"}, "pattern"), ({"format": "hostname"}, "format"),
                                           ({"format": "date"}, "format")])
def test_a_length_xgrammar_would_drop_beside_a_pattern_or_format_is_refused_naming_it(cache, extra, beside):
    dropped = {"type": "string", "maxLength": 3, **extra}
    xgr_grammar = xgr.Grammar.from_json_schema(json.dumps(dropped), any_whitespace=False)
    assert "characters{" not in str(xgr_grammar)  # why: xgrammar keeps only the pattern / format
    doc = {"type": "object", "properties": {"host": dropped}}
    with pytest.raises(InvalidRequestError) as e:
        cache.get(GrammarSpec("json_schema", json.dumps(doc)))
    assert f"properties.host.maxLength beside {beside} is not enforced" in str(e.value)
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<t>", "end": "</t>",
                                                "content": {"type": "json_schema", "json_schema": doc}}}
    cache.get(GrammarSpec("structural_tag", json.dumps(tag)))  # a tool grammar: the router's call


def test_a_length_beside_an_unknown_format_holds_and_keywords_as_property_names_are_not_refused(cache):
    doc = {"type": "object", "properties": {"format": {"type": "string", "format": "idn-email", "maxLength": 3},
                                            "pattern": {"type": "string", "maxLength": 3}},
           "required": ["format", "pattern"]}
    assert _accepts(cache, "json_schema", doc, '{"format": "abc", "pattern": "a\\tb"}')
    assert not _accepts(cache, "json_schema", doc, '{"format": "abcd", "pattern": "a"}')


def test_a_structural_tag_regex_format_is_not_a_json_string_and_is_not_checked(cache):
    tag = {"type": "structural_tag", "format": {"type": "regex", "pattern": "a\\tb"}}
    assert _accepts(cache, "structural_tag", tag, "a\tb")


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    return LLMEngine(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama"),
                     EngineConfig(num_kv_blocks=64))


def _biased_towards(engine: LLMEngine, wanted) -> tuple[tuple[int, float], ...]:
    """A logit bias pushing every token whose text ``wanted`` picks (the mask still wins)."""
    vocab = engine.grammars.tokenizer_info.decoded_vocab
    return tuple((i, 50.0) for i, text in enumerate(vocab) if text and wanted(text))


def test_the_tiny_models_outputs_under_a_length_bounded_schema_parse(tiny_engine):
    """Pushed towards control characters (which the old grammar let in raw) and towards a
    backslash (which must then open a valid escape), every output still parses."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                "code": {"type": "string", "minLength": 3, "maxLength": 6}},
              "required": ["city", "code"]}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    biases = {"free": (), "control": _biased_towards(tiny_engine, lambda t: any(b < 0x20 for b in t)),
              "backslash": _biased_towards(tiny_engine, lambda t: t == b"\\")}
    assert biases["control"] and biases["backslash"]
    for name, bias in biases.items():
        for seed in range(2):
            tiny_engine.add_request(f"{name}{seed}", [5 + seed, 6, 7, 8], SamplingParams(
                temperature=1.0, seed=seed, grammar=spec, max_tokens=80, logit_bias=bias))
    tokens: dict[str, list[int]] = {f"{name}{seed}": [] for name in biases for seed in range(2)}
    while tiny_engine.has_unfinished_requests:
        for out in tiny_engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    vocab, stops = tiny_engine.grammars.tokenizer_info.decoded_vocab, set(tiny_engine.model_config.eos_token_ids)
    for rid, ids in tokens.items():
        value = json.loads(b"".join(vocab[t] for t in ids if t not in stops).decode())
        assert len(value["city"]) <= 12 and 3 <= len(value["code"]) <= 6, (rid, value)
