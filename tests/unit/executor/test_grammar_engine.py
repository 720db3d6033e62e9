"""Constrained decoding through LLMEngine on the tiny random checkpoint: outputs follow
their grammar, the mask never leaks into free rows, how a grammar's end meets min_tokens /
ignore_eos / max_tokens, preemption, and resuming a migrated stream inside its grammar."""
from __future__ import annotations

import re

import pytest

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
from services.executor.engine.sequence import FinishReason
from services.executor.errors import InvalidRequestError
from weft.testing.tiny_model import make_tiny_checkpoint

MAX_STEPS = 400
PROMPT = [5, 6, 7, 8, 9, 10]
PATTERN = "[0-9]{3}-[a-z]{1,3}"  # bounded: a random model would spell [a-z]+ on forever
CODE = GrammarSpec("regex", PATTERN)
YES_NO = GrammarSpec("ebnf", 'root ::= "yes" | "no"')


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLMEngine(checkpoint, EngineConfig(num_kv_blocks=64))


def _greedy(grammar: GrammarSpec | None = None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 24)
    return SamplingParams(temperature=0.0, grammar=grammar, **kw)


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Add all, step until idle; each request's (tokens, finish reason)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, FinishReason] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    else:
        raise AssertionError(f"engine still busy after {MAX_STEPS} steps")
    return {rid: (tokens[rid], reasons[rid]) for rid in requests}


def _text(engine: LLMEngine, tokens: list[int]) -> str:
    """Decoded output without the stop token (xgrammar's view of the vocabulary)."""
    vocab = engine.grammars.tokenizer_info.decoded_vocab
    stops = set(engine.model_config.eos_token_ids)
    return b"".join(vocab[t] for t in tokens if t not in stops).decode()


def test_regex_and_ebnf_outputs_match_and_end_with_stop(engine):
    out = _run(engine, {"re": (PROMPT, _greedy(CODE)), "yn": (PROMPT, _greedy(YES_NO))})
    for rid, pattern in (("re", PATTERN), ("yn", "yes|no")):
        tokens, reason = out[rid]
        assert reason is FinishReason.STOP
        assert tokens[-1] in engine.model_config.eos_token_ids
        assert re.fullmatch(pattern, _text(engine, tokens)), _text(engine, tokens)


def test_free_rows_sharing_a_step_with_constrained_ones_get_exactly_their_unconstrained_tokens(engine):
    free = {f"free{i}": ([11 + i, 12, 13, 14], _greedy(max_tokens=12, ignore_eos=True)) for i in range(3)}
    alone = _run(engine, {f"{rid}-alone": req for rid, req in free.items()})
    mixed = _run(engine, {**free, "c1": (PROMPT, _greedy(CODE)), "c2": ([20, 21, 22], _greedy(YES_NO))})
    for rid in free:
        assert mixed[rid] == alone[f"{rid}-alone"]
    assert re.fullmatch(PATTERN, _text(engine, mixed["c1"][0]))


def test_a_constrained_request_differs_from_its_free_run(engine):
    """Guards the test above: the mask does change what a constrained row samples here."""
    out = _run(engine, {"free": (PROMPT, _greedy(max_tokens=6, ignore_eos=True)), "c": (PROMPT, _greedy(CODE))})
    assert out["free"][0][:3] != out["c"][0][:3]


def test_the_grammars_end_beats_min_tokens_and_ignore_eos(engine):
    out = _run(engine, {"min": (PROMPT, _greedy(YES_NO, min_tokens=10)),
                        "ign": (PROMPT, _greedy(YES_NO, ignore_eos=True))})
    for tokens, reason in out.values():
        assert reason is FinishReason.STOP and len(tokens) < 10
        assert _text(engine, tokens) in ("yes", "no")


def test_max_tokens_first_gives_length_and_a_valid_prefix(engine):
    full, _ = _run(engine, {"full": (PROMPT, _greedy(CODE))})["full"]
    tokens, reason = _run(engine, {"cut": (PROMPT, _greedy(CODE, max_tokens=2))})["cut"]
    assert reason is FinishReason.LENGTH and tokens == full[:2]


def test_preemption_and_recompute_keep_the_matcher_in_step(checkpoint, engine):
    """Four requests in a pool that holds fewer: some are preempted mid-output and
    recomputed; each still ends exactly as when it ran alone."""
    prompts = {f"p{i}": [30 + i, 40 + i] * 5 for i in range(4)}
    alone = {rid: _run(engine, {rid: (p, _greedy(CODE))})[rid] for rid, p in prompts.items()}
    small = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=7, block_size=4, max_num_seqs=4))
    crowded = _run(small, {rid: (p, _greedy(CODE)) for rid, p in prompts.items()})
    assert small.num_preemptions > 0
    assert crowded == alone
    assert all(reason is FinishReason.STOP for _, reason in crowded.values())


def test_a_resumed_stream_continues_inside_its_grammar(engine):
    full, reason = _run(engine, {"first": (PROMPT, _greedy(CODE))})["first"]
    assert reason is FinishReason.STOP and len(full) > 3
    sent = full[:3]
    rest, reason = _run(engine, {"again": (PROMPT + sent, _greedy(CODE, resumed_output_tokens=len(sent)))})["again"]
    assert reason is FinishReason.STOP
    assert re.fullmatch(PATTERN, _text(engine, sent + rest))


def test_resumed_tokens_the_grammar_rejects_are_refused_naming_the_field(engine):
    letters = [t for t, b in enumerate(engine.grammars.tokenizer_info.decoded_vocab) if b == b"a"]
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", PROMPT + letters, _greedy(CODE, resumed_output_tokens=1))
    assert err.value.field == "sampling.resumed_output_tokens"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("long", PROMPT, _greedy(CODE, resumed_output_tokens=len(PROMPT) + 1))
    assert err.value.field == "sampling.resumed_output_tokens"
    assert "bad" not in engine.requests and "long" not in engine.requests


def test_a_bad_grammar_is_refused_at_admission_and_leaves_the_engine_unchanged(engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", PROMPT, _greedy(GrammarSpec("json_schema", '{"type": "objec"}')))
    assert err.value.field == "grammar.json_schema"
    assert "bad" not in engine.requests and not engine.has_unfinished_requests


def test_one_compile_serves_every_request_with_the_same_grammar(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=64))
    _run(engine, {f"r{i}": (PROMPT, _greedy(CODE)) for i in range(3)})
    _run(engine, {"later": (PROMPT, _greedy(GrammarSpec("regex", PATTERN)))})
    assert engine.grammars.num_compiles == 1


@pytest.mark.parametrize("kind,text", [
    ("json_object", ""),
    ("json_schema", '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", '
                       '"content": {"type": "const_string", "value": "ok"}, "end": "</a>"}}'),
])
def test_every_kind_constrains_the_tiny_model(engine, kind, text):
    tokens, reason = _run(engine, {"k": (PROMPT, _greedy(GrammarSpec(kind, text), max_tokens=12))})["k"]
    out = _text(engine, tokens)
    if kind == "structural_tag":
        assert reason is FinishReason.STOP and out == "<a>ok</a>"
    else:  # a random model rarely closes its object within 12 tokens: a valid prefix
        assert out.startswith('{"n": ' if kind == "json_schema" else "{")
