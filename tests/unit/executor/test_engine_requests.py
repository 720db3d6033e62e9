"""LLMEngine request handling on a tiny random checkpoint: validation, abort, stop
conditions, seeded sampling, kv events. (Greedy parity with transformers lives in
tests/parity.)"""
from __future__ import annotations

import pytest

from services.executor.kv.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.errors import InvalidRequestError
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import FinishReason
from weft.testing.tiny_model import make_tiny_checkpoint

MAX_STEPS = 400  # no test here needs more; a loop past it is a hang, not slowness
VOCAB = 1024  # the "tiny" preset
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


def _engine(checkpoint, **options) -> LLMEngine:
    options.setdefault("num_kv_blocks", 64)
    return LLMEngine(checkpoint, EngineConfig(**options))


def _run(engine: LLMEngine) -> dict[str, tuple[list[int], FinishReason]]:
    """Step until idle; each request's tokens and finish reason."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
    else:
        raise AssertionError(f"engine still busy after {MAX_STEPS} steps")
    return {rid: (tokens.get(rid, []), reason) for rid, reason in finished.items()}


def _prompt(n: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % VOCAB for i in range(n)]


# -- invalid requests -------------------------------------------------------------------
BAD_PROMPTS = {
    "empty": [],
    "id_equal_to_vocab": [5, VOCAB, 6],
    "negative_id": [5, -1],
    "longer_than_max_model_len": _prompt(65),
    "as_long_as_max_model_len": _prompt(64),  # leaves no room for one new token
    "non_integer_id": [5, 6.5],
    "string_id": [5, "6"],
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt_is_refused_naming_the_prompt_and_the_next_request_is_served(checkpoint, case):
    engine = _engine(checkpoint, max_model_len=64)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", BAD_PROMPTS[case], GREEDY)
    assert err.value.field == "prompt"
    assert not engine.requests and not engine.has_unfinished_requests
    engine.add_request("good", _prompt(5), GREEDY)
    tokens, reason = _run(engine)["good"]
    assert len(tokens) == GREEDY.max_tokens and reason is FinishReason.LENGTH


def test_duplicate_request_id_is_refused_and_the_first_one_still_finishes(checkpoint):
    engine = _engine(checkpoint)
    engine.add_request("same", _prompt(5), GREEDY)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("same", _prompt(9, start=300), GREEDY)
    assert err.value.field == "request_id"
    result = _run(engine)
    assert list(result) == ["same"]
    assert len(result["same"][0]) == GREEDY.max_tokens


# -- abort ----------------------------------------------------------------------------
def test_abort_mid_generation_frees_every_block_at_once(checkpoint):
    engine = _engine(checkpoint)
    engine.add_request("long", _prompt(40), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    produced = 0
    while produced < 3:
        produced += sum(len(o.new_token_ids) for o in engine.step())
    assert engine.pool.num_free_blocks < engine.num_blocks
    assert engine.abort_request("long")
    assert engine.pool.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished_requests
    assert engine.step() == []
    assert not engine.abort_request("long")  # already gone


def test_abort_of_one_request_leaves_the_others_running(checkpoint):
    engine = _engine(checkpoint)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("stay", _prompt(20), params)
    engine.add_request("go", _prompt(20, start=500), params)
    engine.step()
    engine.abort_request("go")
    result = _run(engine)
    assert list(result) == ["stay"]
    assert result["stay"][1] is FinishReason.LENGTH
    assert engine.pool.num_free_blocks == engine.num_blocks


def test_abort_of_a_waiting_request_takes_it_out_of_the_queue(checkpoint):
    engine = _engine(checkpoint, max_num_seqs=1)
    engine.add_request("running", _prompt(5), GREEDY)
    engine.add_request("queued", _prompt(5, start=99), GREEDY)
    engine.step()
    assert engine.abort_request("queued")
    assert list(_run(engine)) == ["running"]


# -- stop conditions --------------------------------------------------------------------
def _greedy_tokens(checkpoint, prompt: list[int], n: int) -> list[int]:
    engine = _engine(checkpoint)
    engine.add_request("probe", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return _run(engine)["probe"][0]


def test_stop_token_ends_the_request_at_exactly_the_step_it_is_produced(checkpoint):
    tokens = _greedy_tokens(checkpoint, _prompt(12), 20)
    # the first token that did not appear before it, at least a few steps in
    k = next(i for i in range(4, len(tokens)) if tokens[i] not in tokens[:i]) + 1
    engine = _engine(checkpoint)
    engine.add_request("r", _prompt(12), SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(tokens[k - 1],)))
    out, reason = _run(engine)["r"]
    assert reason is FinishReason.STOP
    assert out == tokens[:k]


def _prompt_with_early_eos(checkpoint, eos_ids: frozenset[int]) -> tuple[list[int], int]:
    """A prompt whose greedy continuation hits an EOS id within 40 tokens, and the
    1-based position of that EOS."""
    for start in (10, 20, 30, 40, 50, 60):
        prompt = list(range(start, start + 40))
        tokens = _greedy_tokens(checkpoint, prompt, 40)
        hit = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        if hit is not None:
            return prompt, hit + 1
    raise AssertionError("no tried prompt produces an EOS token; pick others")


def test_eos_stops_the_request_unless_ignore_eos(checkpoint):
    engine = _engine(checkpoint)
    prompt, k = _prompt_with_early_eos(checkpoint, engine.eos_token_ids)
    engine.add_request("eos", prompt, SamplingParams(max_tokens=40, temperature=0.0))
    engine.add_request("ignore", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    result = _run(engine)
    tokens, reason = result["eos"]
    assert reason is FinishReason.STOP and len(tokens) == k and tokens[-1] in engine.eos_token_ids
    tokens, reason = result["ignore"]
    assert reason is FinishReason.LENGTH and len(tokens) == 40


def test_min_tokens_keeps_generating_past_an_early_eos(checkpoint):
    engine = _engine(checkpoint)
    prompt, k = _prompt_with_early_eos(checkpoint, engine.eos_token_ids)
    engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0.0, min_tokens=k + 1))
    tokens, _ = _run(engine)["r"]
    assert len(tokens) > k


def test_max_tokens_ends_the_request_with_length(checkpoint):
    engine = _engine(checkpoint)
    engine.add_request("r", _prompt(7), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    tokens, reason = _run(engine)["r"]
    assert reason is FinishReason.LENGTH and len(tokens) == 5


def test_reaching_max_model_len_ends_the_request_with_length(checkpoint):
    engine = _engine(checkpoint, max_model_len=32)
    engine.add_request("r", _prompt(28), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    tokens, reason = _run(engine)["r"]
    assert reason is FinishReason.LENGTH and 28 + len(tokens) == 32


# -- seeded sampling --------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_across_engines_and_batch_companions(checkpoint):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    first = _engine(checkpoint)
    first.add_request("r", _prompt(9), seeded)
    alone = _run(first)["r"][0]

    second = _engine(checkpoint)
    second.add_request("noise", _prompt(30, start=700), SamplingParams(max_tokens=20, temperature=1.0))
    second.add_request("r", _prompt(9), seeded)
    second.add_request("greedy", _prompt(3, start=5), GREEDY)
    assert _run(second)["r"][0] == alone

    other_seed = _engine(checkpoint)
    other_seed.add_request("r", _prompt(9), SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))
    assert _run(other_seed)["r"][0] != alone  # the seed matters (12 draws from 1024 ids)


# -- kv events --------------------------------------------------------------------------
def test_replayed_kv_events_equal_the_hashes_the_pool_holds(checkpoint):
    # 12 blocks of 16 tokens: shared prefixes give hits, and the pool is small enough
    # that later requests evict earlier ones' cached blocks.
    engine = _engine(checkpoint, num_kv_blocks=12)
    system = _prompt(48, start=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    resident: set[int] = set()
    removed = 0
    for wave in range(3):
        for i in range(2):
            engine.add_request(f"w{wave}-{i}", system + _prompt(20 + 9 * i, start=100 * (wave + 1) + i), params)
        _run(engine)
        for ev in engine.take_kv_events():
            if isinstance(ev, BlockStored):
                resident.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                resident.difference_update(ev.block_hashes)
                removed += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                resident.clear()
        assert resident == set(engine.pool.cached_hashes())
    assert removed > 0, "the pool never evicted: the test no longer covers BlockRemoved"
    assert resident
