"""Hostile grammars (issue 15): a small JSON schema whose ``pattern`` regexes take xgrammar
seconds to compile. Measured on SmolLM2-135M's tokenizer: 400 properties of
``[a-z]{3,90}`` (21 KB) compiled for 18 s, ``([a-z]{1,30}){1,30}`` (one 20-character
pattern) for 9.5 s. A compile past its 5 s deadline keeps its worker (native code cannot be
interrupted), and two such requests with distinct schemas made every other tenant's new
grammar a 429 ("compilers are busy") for as long as they ran. Such schemas are now refused
before any compile starts; ordinary patterns still compile."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.executor.engine.sampling_params import GrammarSpec
from services.executor.errors import InvalidRequestError
from services.executor.grammar import GrammarCache, GrammarLimits, load_tokenizer_info
from services.executor.grammar.pattern_cost import MAX_PATTERN_UNITS, pattern_units
from services.executor.model.config import ModelConfig
from weft.testing.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    config = ModelConfig.from_dir(path)
    return load_tokenizer_info(path, config.vocab_size, config.eos_token_ids)


@pytest.fixture
def cache(info):
    c = GrammarCache(info, GrammarLimits(compile_threads=1))  # one hostile compile would fill it
    yield c
    c.close()


def _props(n: int, pattern: str) -> GrammarSpec:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": pattern} for i in range(n)}}
    return GrammarSpec("json_schema", json.dumps(schema))


BOMBS = [
    _props(400, "[a-z]{3,90}"),  # 18 s on SmolLM2
    _props(1, "([a-z]{1,30}){1,30}"),  # 9.5 s
    _props(1, "(((a{1,10}){1,10}){1,10})"),
    GrammarSpec("json_schema", json.dumps({"type": "object", "patternProperties": {"^([a-z]{1,40}){1,40}$": {}}})),
    GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": {"type": "string", "pattern": "([0-9]{1,50}){1,50}"}}})),
]


@pytest.mark.parametrize("spec", BOMBS, ids=lambda s: s.text[:60])
def test_a_schema_whose_patterns_would_compile_for_seconds_is_refused_without_compiling(cache, spec):
    with pytest.raises(InvalidRequestError) as err:
        cache.get(spec)
    assert err.value.field == f"grammar.{spec.kind}" and "repeat too much" in str(err.value)
    assert cache.num_compiles == 0 and not cache.workers  # no worker was ever held
    # another tenant's grammar is compiled at once, not refused as "compilers busy"
    assert cache.get(_props(3, "[a-z]{3,9}")) is not None


@pytest.mark.parametrize("pattern", [
    "^[A-Za-z ]{12,24}$", r"(\d{1,3}\.){3}\d{1,3}", r"^[A-Z]{2}\d{6,10}$", r"^\+?[0-9]{7,15}$",
    "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$", "(ab|cd){2}x*",
])
def test_ordinary_patterns_still_compile(cache, pattern):
    spec = _props(10, pattern)
    assert cache.get(spec) is not None and cache.num_compiles == 1


def test_twenty_fields_of_a_64_character_pattern_fit_the_budget(cache):
    assert 20 * pattern_units("^[a-z_]{1,64}$") <= MAX_PATTERN_UNITS
    assert cache.get(_props(20, "^[a-z_]{1,64}$")) is not None


def test_a_pattern_word_that_is_data_is_not_costed_as_a_regex_key(cache):
    # a property *named* "pattern" (its value is a schema, not a string) costs nothing
    schema = {"type": "object", "properties": {"pattern": {"type": "string"}}}
    assert cache.get(GrammarSpec("json_schema", json.dumps(schema))) is not None


def test_one_grammar_sent_by_many_requests_at_once_is_compiled_once_and_none_is_refused(cache, monkeypatch):
    """100 concurrent requests with one new schema on SmolLM2: 21 were 429 "compilers are
    busy with grammars that timed out" (none had): each miss started its own compile."""
    from services.executor.grammar import compiler

    callers = 8
    arrived, all_arrived, lock = [0], threading.Event(), threading.Lock()
    check, compile_now = compiler._check_source, GrammarCache._compile_now

    def counting_check(spec, max_bytes):  # every caller passes here before any compile starts
        with lock:
            arrived[0] += 1
            if arrived[0] == callers:
                all_arrived.set()
        return check(spec, max_bytes)

    def held_compile(self, spec):  # the compile ends only once every caller has asked for it
        assert all_arrived.wait(30), "deadlock guard"
        return compile_now(self, spec)

    monkeypatch.setattr(compiler, "_check_source", counting_check)
    monkeypatch.setattr(GrammarCache, "_compile_now", held_compile)
    spec = _props(5, "[a-z]{3,9}")
    with ThreadPoolExecutor(callers) as pool:
        results = list(pool.map(lambda _: _outcome(cache, spec), range(callers)))
    assert all(not isinstance(r, Exception) for r in results), results
    assert len({id(r) for r in results}) == 1 and cache.num_compiles == 1


def _outcome(cache, spec):
    try:
        return cache.get(spec)
    except Exception as e:  # noqa: BLE001 - compared by the test
        return e
