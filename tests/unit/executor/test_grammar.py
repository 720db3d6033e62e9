"""services/executor/grammar on its own: the tokenizer as xgrammar sees it, the compiled-
grammar cache and its limits, GrammarState and the per-step mask (real xgrammar, the tiny
test tokenizer). Engine behaviour lives in test_grammar_engine.py."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from services.executor.engine.sampling_params import GrammarSpec
from services.executor.errors import CapacityError, InvalidRequestError
from services.executor.grammar import GrammarCache, GrammarLimits, GrammarState, load_tokenizer_info, mask_logits
from services.executor.grammar.mask import MASK_SECONDS
from services.executor.model.config import ModelConfig
from tests.threads import in_thread as _in_thread
from weft.testing.tiny_model import make_tiny_checkpoint

DIGITS = GrammarSpec("regex", "[0-9]+")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A checkpoint whose logits are wider than its tokenizer (padded embedding rows)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), preset="tiny", arch="qwen2")


@pytest.fixture(scope="module")
def info(qwen2):
    config = ModelConfig.from_dir(qwen2)
    return load_tokenizer_info(qwen2, config.vocab_size, config.eos_token_ids)


@pytest.fixture
def cache(info):
    c = GrammarCache(info)
    yield c
    c.close()


def _decode(info, token_id: int) -> bytes:
    return info.decoded_vocab[token_id]


def _allowed(cache: GrammarCache, state: GrammarState) -> list[int]:
    logits = torch.zeros(1, cache.vocab_size)
    mask_logits(logits, [state])
    return torch.nonzero(logits[0] > float("-inf")).flatten().tolist()


# -- tokenizer info ----------------------------------------------------------------------
def test_mask_width_is_the_models_logits_and_stop_tokens_are_its_eos_ids(qwen2, info):
    config = ModelConfig.from_dir(qwen2)
    tokenizer_ids = len(json.loads((qwen2 / "tokenizer.json").read_text())["model"]["vocab"])
    assert info.vocab_size == config.vocab_size > tokenizer_ids
    assert sorted(info.stop_token_ids) == sorted(config.eos_token_ids)


def _token(info, text: bytes) -> int:
    return next(i for i, b in enumerate(info.decoded_vocab) if b == text)


def test_padded_rows_and_special_tokens_are_never_allowed(cache, info):
    state = GrammarState(cache.get(GrammarSpec("json_object")))
    assert state.replay([_token(info, b"{"), _token(info, b'"')]) is None  # inside a key: any text
    allowed = set(_allowed(cache, state))
    assert _token(info, b"a") in allowed
    padded = set(range(len(info.decoded_vocab) - 64, len(info.decoded_vocab)))
    assert not allowed & padded
    assert not allowed & {0, 1, 2}  # <|endoftext|>, <|im_start|>, <|im_end|>: special, not literal text


# -- the cache ---------------------------------------------------------------------------
def test_the_same_grammar_compiles_once_and_equal_texts_share_it(cache):
    first = cache.get(DIGITS)
    again = cache.get(GrammarSpec("regex", "[0-9]+"))
    assert again is first and cache.num_compiles == 1
    cache.get(GrammarSpec("ebnf", 'root ::= [0-9]+'))  # another kind is another key
    assert cache.num_compiles == 2


def test_the_cache_keeps_at_most_max_entries_dropping_the_least_recently_used(info):
    cache = GrammarCache(info, GrammarLimits(max_entries=2))
    a, b, c = (GrammarSpec("regex", f"{ch}+") for ch in "abc")
    cache.get(a)
    cache.get(b)
    cache.get(a)  # a is now the most recent
    cache.get(c)  # evicts b
    assert len(cache) == 2
    cache.get(a)
    assert cache.num_compiles == 3
    cache.get(b)
    assert cache.num_compiles == 4
    cache.close()


BAD = {
    "json_schema": ('{"type": "objec"}', "objec"),
    "regex": ("([a-", "Unclosed"),
    "ebnf": ("root ::= foo", "foo"),
    "structural_tag": ('{"type": "structural_tag"}', "format"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_grammar_is_refused_naming_the_field_with_xgrammars_reason(cache, kind):
    text, reason = BAD[kind]
    with pytest.raises(InvalidRequestError) as err:
        cache.get(GrammarSpec(kind, text))
    assert err.value.field == f"grammar.{kind}" and reason in err.value.message
    assert "/project/cpp" not in str(err.value)  # xgrammar's source location is noise to a caller


def test_a_repeated_bad_grammar_is_refused_without_recompiling(cache):
    spec = GrammarSpec("regex", "([a-")
    for _ in range(3):
        with pytest.raises(InvalidRequestError):
            cache.get(spec)
    assert cache.num_compiles == 1


def test_a_schema_that_is_not_json_names_the_field(cache):
    with pytest.raises(InvalidRequestError, match=r"^grammar.json_schema: is not valid JSON"):
        cache.get(GrammarSpec("json_schema", "{not json"))


def test_an_oversized_grammar_is_refused_before_compiling(info):
    cache = GrammarCache(info, GrammarLimits(max_grammar_bytes=100))
    with pytest.raises(InvalidRequestError, match=r"^grammar.regex: 101 bytes is over the limit of 100"):
        cache.get(GrammarSpec("regex", "a" * 101))
    assert cache.num_compiles == 0
    cache.close()


def test_a_deeply_nested_schema_is_refused_before_compiling(cache):
    schema = {"type": "string"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"x": schema}}
    with pytest.raises(InvalidRequestError, match=r"^grammar.json_schema: is nested deeper than"):
        cache.get(GrammarSpec("json_schema", json.dumps(schema)))
    # Python's own recursion limit is no crash either
    with pytest.raises(InvalidRequestError, match=r"^grammar.json_schema: "):
        cache.get(GrammarSpec("json_schema", "[" * 100_000 + "]" * 100_000))
    assert cache.num_compiles == 0


def test_a_compile_past_its_deadline_is_refused_and_the_busy_compilers_refuse_new_ones(info, monkeypatch):
    cache = GrammarCache(info, GrammarLimits(compile_timeout_s=0.05, compile_threads=1))
    release, real = threading.Event(), cache._compile_now

    def hung(spec):
        release.wait()
        return real(spec)

    monkeypatch.setattr(cache, "_compile_now", hung)
    with pytest.raises(InvalidRequestError, match=r"^grammar.regex: did not compile within 0.05s"):
        cache.get(GrammarSpec("regex", "a+"))
    with pytest.raises(CapacityError, match=r"^grammar.regex: the grammar compilers are busy"):
        cache.get(GrammarSpec("regex", "b+"))
    (worker,) = cache.workers
    assert worker.daemon  # a compile that never returns cannot hold up the process's exit
    release.set()
    worker.join()  # the hung compile returns and frees its worker
    assert not cache.workers
    assert cache.get(GrammarSpec("regex", "b+")) is not None  # "busy" was not remembered as a failure
    with pytest.raises(InvalidRequestError, match="did not compile"):  # the timeout was
        cache.get(GrammarSpec("regex", "a+"))
    cache.close()


def _held_compiles(cache, monkeypatch):
    """Compiles that start but finish only when the returned event is set."""
    release, real = threading.Event(), cache._compile_now

    def held(spec):
        release.wait()
        return real(spec)

    monkeypatch.setattr(cache, "_compile_now", held)
    return release


def _one_worker_held(info, monkeypatch, timeout_s: float):
    """A one-worker cache whose worker holds "a+" until the returned event is set: (cache,
    event, that caller's thread, its result dict)."""
    from tests.integration.conftest import wait_for

    cache = GrammarCache(info, GrammarLimits(compile_timeout_s=timeout_s, compile_threads=1))
    release = _held_compiles(cache, monkeypatch)
    first, first_out = _in_thread(cache.get, GrammarSpec("regex", "a+"))
    wait_for(lambda: len(cache.workers) == 1, 30, "the first compile holding the only worker")
    return cache, release, first, first_out


def test_more_new_grammars_than_compilers_wait_for_a_free_one_instead_of_being_refused(info, monkeypatch):
    # CI failure of stop 41: three new grammars at once on a two-worker executor got
    # RESOURCE_EXHAUSTED for the third while the first two were still compiling.
    from tests.integration.conftest import wait_for

    cache, release, first, first_out = _one_worker_held(info, monkeypatch, 60)
    second, second_out = _in_thread(cache.get, GrammarSpec("regex", "b+"))
    wait_for(lambda: cache._waiting == 1, 30, "the second compile waiting for a worker")
    release.set()
    first.join(30), second.join(30)
    assert "error" not in first_out and "error" not in second_out, (first_out, second_out)
    assert first_out["value"] is not None and second_out["value"] is not None
    assert cache.num_compiles == 2 and not cache.workers and cache._waiting == 0
    cache.close()


def test_a_compile_still_waiting_for_a_worker_at_its_deadline_is_refused_as_busy_and_not_remembered(
        info, monkeypatch):
    from tests.integration.conftest import wait_for

    cache, release, first, first_out = _one_worker_held(info, monkeypatch, 0.3)
    with pytest.raises(CapacityError, match=r"^grammar.regex: the grammar compilers are busy"):
        cache.get(GrammarSpec("regex", "b+"))  # waits, the worker stays held past the deadline
    release.set()
    first.join(30)
    wait_for(lambda: not cache.workers, 30, "the held worker leaving")
    assert cache.get(GrammarSpec("regex", "b+")) is not None  # the refusal was not cached
    cache.close()


def test_no_more_than_max_waiting_compiles_wait_for_a_worker(info, monkeypatch):
    from services.executor.grammar import compiler
    from tests.integration.conftest import wait_for

    monkeypatch.setattr(compiler, "MAX_WAITING", 1)
    cache, release, first, _ = _one_worker_held(info, monkeypatch, 60)
    second, second_out = _in_thread(cache.get, GrammarSpec("regex", "b+"))
    wait_for(lambda: cache._waiting == 1, 30, "the second compile waiting")
    with pytest.raises(CapacityError, match="busy"):
        cache.get(GrammarSpec("regex", "c+"))  # refused at once: the queue is full
    release.set()
    first.join(30), second.join(30)
    assert second_out.get("value") is not None
    cache.close()


# -- GrammarState ------------------------------------------------------------------------
def test_a_rejected_token_marks_the_state_failed_without_raising(cache, info):
    state = GrammarState(cache.get(DIGITS), "r1")
    letter = _token(info, b"a")
    assert state.accept(letter) is False
    assert state.failed and state.finished and not state.terminated
    assert state.accept(letter) is False  # stays failed, still no exception


def test_accepting_a_stop_token_terminates_the_grammar(cache, info):
    state = GrammarState(cache.get(DIGITS))
    seven = _token(info, b"7")
    assert state.replay([seven, seven]) is None
    assert not state.terminated
    assert state.accept(info.stop_token_ids[0]) and state.terminated and not state.failed


# -- mask_logits -------------------------------------------------------------------------
def test_without_a_constrained_row_the_mask_is_a_no_op(cache):
    logits = torch.randn(3, cache.vocab_size)
    before = logits.clone()
    assert mask_logits(logits, [None, None, None]) == 0.0
    assert torch.equal(logits, before)


def _mask_steps() -> float:
    return next(s.value for m in MASK_SECONDS.collect() for s in m.samples if s.name.endswith("_count"))


def test_only_constrained_rows_are_masked_and_they_allow_only_the_grammar(cache, info):
    logits = torch.randn(3, cache.vocab_size, generator=torch.Generator().manual_seed(0))
    before, steps = logits.clone(), _mask_steps()
    mask_logits(logits, [None, GrammarState(cache.get(DIGITS)), None])
    assert _mask_steps() == steps + 1  # the step's cost is in the histogram
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.nonzero(logits[1] > float("-inf")).flatten().tolist()
    assert allowed and all(_decode(info, t).isdigit() for t in allowed)
    assert torch.equal(logits[1, allowed], before[1, allowed])  # allowed logits keep their values


def test_a_row_with_no_allowed_token_gets_only_its_stop_token(cache, info):
    state = GrammarState(cache.get(DIGITS), "dead")
    state.accept(_token(info, b"a"))  # failed
    logits = torch.randn(1, cache.vocab_size)
    mask_logits(logits, [state])
    finite = torch.nonzero(torch.isfinite(logits[0])).flatten().tolist()
    assert finite == [info.stop_token_ids[0]]
    assert not torch.isnan(logits.softmax(-1)).any()
