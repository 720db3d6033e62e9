"""Demote-on-finish under and without pool pressure (TierOps.observe).

A finished session request's blocks are written to the cachestore only while the
executor's pool is held at least ``finish_min_held``: below it LRU keeps them through any
pause, and on a CPU the write competes with the steps (one agent-benchmark run: program p99
15 % longer with the unconditional write on every seed; a rerun was mixed).
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.executor.engine.engine import StepOutput
from services.executor.tiers.offload import DemoteOnFinish
from services.executor.tiers.tier_ops import TierOps, _held_fraction
from services.mesh import metrics
from weft.v1 import common_pb2, executor_pb2


class RecordingDemoter:
    def __init__(self) -> None:
        self.demoted: list[list[int]] = []

    async def demote(self, token_ids=(), **_) -> None:
        self.demoted.append(list(token_ids))


class NoPromotion:
    cost = SimpleNamespace(observe_prefill=lambda *_: None)


def request(rid: str, session_id: str = "s") -> executor_pb2.ExecuteRequest:
    msg = executor_pb2.ExecuteRequest(request_id=rid, prompt_token_ids=[1, 2, 3])
    if session_id:
        msg.session.CopyFrom(common_pb2.SessionInfo(session_id=session_id))
    return msg


def finished(rid: str) -> StepOutput:
    return StepOutput(rid, (9,), (), True, None, 3, 0, 1)


def run(ops: TierOps, *requests) -> None:
    async def main() -> None:
        ops.promote_before_prefill = False
        for r in requests:
            await ops.before_submit(r)
            ops.observe(r.request_id, finished(r.request_id))
        await ops.drain()

    asyncio.run(main())


def finish_demotions(outcome: str) -> float:
    return metrics.REGISTRY.get_sample_value("weft_executor_finish_demotions_total", {"outcome": outcome}) or 0.0


@pytest.mark.parametrize("held, written", [(0.2, False), (0.49, False), (0.5, True), (0.9, True)])
def test_a_finished_session_is_written_only_while_the_pool_is_held_past_the_threshold(held, written):
    demoter = RecordingDemoter()
    ops = TierOps(NoPromotion(), demoter, DemoteOnFinish.SESSIONS, finish_min_held=0.5, pool_held=lambda: held)
    before = {o: finish_demotions(o) for o in ("written", "skipped")}
    run(ops, request("r1"))
    assert demoter.demoted == ([[1, 2, 3, 9]] if written else [])
    assert ops.num_finish_demotions_skipped == (0 if written else 1)
    # the operator sees the same on /metrics
    assert finish_demotions("written") - before["written"] == (1 if written else 0)
    assert finish_demotions("skipped") - before["skipped"] == (0 if written else 1)


def test_threshold_zero_writes_on_an_empty_pool_and_never_reads_the_pool():
    demoter = RecordingDemoter()

    def pool_held() -> float:
        raise AssertionError("the pool is not read when every finish is written")

    ops = TierOps(NoPromotion(), demoter, DemoteOnFinish.SESSIONS, finish_min_held=0.0, pool_held=pool_held)
    run(ops, request("r1"), request("r2", session_id=""))  # the session-less one is not written
    assert demoter.demoted == [[1, 2, 3, 9]] and ops.num_finish_demotions_skipped == 0


def test_never_and_session_less_requests_are_not_counted_as_skipped_by_pressure():
    demoter = RecordingDemoter()
    ops = TierOps(NoPromotion(), demoter, DemoteOnFinish.NEVER, finish_min_held=0.5, pool_held=lambda: 0.0)
    run(ops, request("r1"))
    assert demoter.demoted == [] and ops.num_finish_demotions_skipped == 0


def test_held_fraction_counts_free_cached_free_and_pinned_blocks_as_room():
    pool = SimpleNamespace(num_free_blocks=30, num_blocks=40)
    assert _held_fraction(SimpleNamespace(pool=pool)) == pytest.approx(0.25)
    assert _held_fraction(SimpleNamespace(pool=SimpleNamespace(num_free_blocks=0, num_blocks=0))) == 1.0
    # pins are idle sessions' blocks that yield to live work: a pool full of pins is room
    pinned = SimpleNamespace(num_pinned_blocks=6)
    assert _held_fraction(SimpleNamespace(pool=pool, pins=pinned)) == pytest.approx(0.1)
    full_of_pins = SimpleNamespace(pool=SimpleNamespace(num_free_blocks=0, num_blocks=40),
                                   pins=SimpleNamespace(num_pinned_blocks=40))
    assert _held_fraction(full_of_pins) == 0.0


def test_a_real_engine_reads_a_running_request_as_held_and_its_pin_as_room(tmp_path):
    """On a real engine: an idle pool is room; a running request holds its blocks; once it
    finishes with a keep (pinned) they are room again, though no longer free."""
    from services.executor.engine.config import EngineConfig
    from services.executor.engine.engine import LLMEngine
    from services.executor.engine.sampling_params import SamplingParams
    from services.executor.engine.sequence import SessionOptions
    from weft.testing.tiny_model import make_tiny_checkpoint

    engine = LLMEngine(make_tiny_checkpoint(tmp_path / "tiny", preset="tiny", arch="llama"),
                       EngineConfig(num_kv_blocks=16, block_size=4))
    assert _held_fraction(engine) == 0.0
    engine.add_request("r", list(range(10, 30)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       session=SessionOptions(session_id="s", pin_ttl_s=60.0))
    engine.step()  # prefill: 20 prompt tokens in 5 blocks
    running = _held_fraction(engine)
    assert running >= 5 / 16
    for _ in range(10):
        if not engine.has_unfinished_requests:
            break
        engine.step()
    assert not engine.has_unfinished_requests and engine.pins.num_pinned_blocks >= 5
    assert engine.pool.num_free_blocks < 16  # pinned: not free, not evictable by LRU ...
    assert _held_fraction(engine) == 0.0  # ... but room for this gate: the pin yields to live work
