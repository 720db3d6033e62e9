"""Live work before kept KV: an idle session's pin (the *keep* of a tool pause) yields
to a running request that needs a block and to a waiting one that does not fit,
before anything is preempted or left waiting; the pin whose session is expected back
last yields first, and a request never releases its own session's pin."""
from __future__ import annotations

import pytest

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import SessionOptions
from weft.testing.tiny_model import make_tiny_checkpoint

BS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny")


def _engine(checkpoint, num_kv_blocks: int) -> LLMEngine:
    return LLMEngine(checkpoint, EngineConfig(num_kv_blocks=num_kv_blocks, block_size=BS))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 1000 for i in range(n)]


def _run(engine: LLMEngine) -> tuple[dict, dict, dict]:
    """Steps to the end: (last output, tokens, (first-token step, finish step)) by request id."""
    done, tokens, steps = {}, {}, {}
    for step in range(400):
        if not engine.has_unfinished_requests:
            return done, tokens, steps
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            steps.setdefault(out.request_id, [step, None])
            if out.finished:
                done[out.request_id] = out
                steps[out.request_id][1] = step
    raise AssertionError("engine busy after 400 steps")


def _pin(engine: LLMEngine, sid: str, n: int, start: int, ttl_s: float) -> None:
    engine.add_request(sid, _prompt(n, start), _greedy(1), session=SessionOptions(sid, pin_ttl_s=ttl_s))
    _run(engine)
    assert sid in engine.pins


def test_a_growing_request_takes_a_pin_instead_of_being_preempted(checkpoint):
    reference = _engine(checkpoint, 12)
    reference.add_request("live", _prompt(8, 3), _greedy(30))
    expected = _run(reference)[1]["live"]

    engine = _engine(checkpoint, 12)
    _pin(engine, "idle", 28, 500, ttl_s=60.0)  # 7 of 12 blocks pinned
    engine.add_request("live", _prompt(8, 3), _greedy(30))  # grows to 38 tokens: 10 blocks
    assert _run(engine)[1]["live"] == expected
    assert engine.num_preemptions == 0  # before: preempted itself, then recomputed
    assert "idle" not in engine.pins and engine.scheduler.num_pin_yields >= 1


def test_a_waiting_request_is_admitted_at_once_and_the_session_back_last_yields_first(checkpoint):
    engine = _engine(checkpoint, 20)
    _pin(engine, "soon", 16, 100, ttl_s=10.0)  # 4 blocks
    _pin(engine, "late", 16, 300, ttl_s=50.0)  # 4 blocks
    engine.add_request("long", _prompt(8, 7), _greedy(40))  # ends at 48 tokens: 12 blocks
    for _ in range(32):  # "long" at 40 tokens: 10 blocks, 2 free
        engine.step()
    engine.add_request("new", _prompt(16, 900), _greedy(2))  # needs 5
    steps = _run(engine)[2]
    # before: "new" waited for "long" to finish and give its blocks back
    assert steps["new"][0] < steps["long"][1]
    assert "late" not in engine.pins and "soon" in engine.pins


def test_a_hop_never_releases_its_own_sessions_pin(checkpoint):
    engine = _engine(checkpoint, 15)
    _pin(engine, "other", 12, 700, ttl_s=10.0)  # 3 blocks, back first
    ctx = _prompt(24, 40)
    engine.add_request("mine", ctx, _greedy(1), session=SessionOptions("mine", pin_ttl_s=60.0))
    tokens = _run(engine)[1]  # 6 blocks pinned, back last
    hop = ctx + tokens["mine"] + _prompt(24, 77)  # 49 tokens: 7 fresh blocks, 6 free
    engine.add_request("mine-1", hop, _greedy(4), session=SessionOptions("mine"))
    out = _run(engine)[0]["mine-1"]
    assert out.num_cached_tokens == 24  # its own kept prefix, hit
    assert "other" not in engine.pins and engine.num_preemptions == 0
