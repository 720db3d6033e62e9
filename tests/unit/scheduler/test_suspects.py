"""A request aboard repeated engine deaths is not moved on again (suspects.py); a killed
process (transport error) is not an engine death. The real mesh case:
tests/adversarial/test_operator_poison_request.py."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.scheduler.errors import ExecutorLostError
from services.scheduler.migration import (
    Attempt, ExecutorFailed, MigrationExhausted, MigrationPolicy, NoReplacement, Piece, StreamProgress,
    migrating_stream,
)
from services.scheduler.policy.suspects import SuspectedPoison, SuspectRegistry, is_engine_failure

FAST = MigrationPolicy(max_attempts=4, stall_factor=5, min_stall_s=0.05, first_token_timeout_s=0.5,
                       replacement_wait_s=0.3)


def dying(name: str, engine: bool, calls: list[str]):
    async def stream(attempt: Attempt):
        calls.append(name)
        yield Piece((7,), name, False)
        raise ExecutorFailed(name, "UNAVAILABLE: engine thread is not running" if engine
                             else "UNAVAILABLE: Socket closed", engine_failed=engine)
    return stream


def run(engine: bool, calls: list[str]):
    executors = {n: dying(n, engine, calls) for n in ("a", "b", "c", "d")}

    def pick(attempt: Attempt):
        for name, make in executors.items():
            if name not in attempt.exclude:
                return make(attempt)
        raise NoReplacement("all excluded")

    async def main():
        progress = StreamProgress((1,), max_tokens=50, min_tokens=0, seed=None)
        return [p async for p in migrating_stream(progress, FAST, pick)]
    return asyncio.run(asyncio.wait_for(main(), 10))


def test_a_second_engine_death_with_the_request_aboard_ends_it_unretried():
    calls: list[str] = []
    with pytest.raises(SuspectedPoison, match="a, b.*not retried"):
        run(True, calls)
    assert calls == ["a", "b"]


def test_killed_processes_still_use_every_attempt():
    calls: list[str] = []
    with pytest.raises(MigrationExhausted):
        run(False, calls)
    assert calls == ["a", "b", "c", "d"]


def _rpc_error(details: str, origin: str | None) -> grpc.aio.AioRpcError:
    trailers = grpc.aio.Metadata(*((("weft-error", origin),) if origin else ()))
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), trailers, details)


def test_engine_failures_are_told_by_the_error_the_executor_chose_not_by_its_words():
    engine_dead = [_rpc_error(d, "EngineDeadError") for d in (
        "executor executor-0: engine thread died", "engine thread is not running", "engine stopped",
        "executor e: engine made no progress for 60 s")]
    for error in engine_dead:
        assert is_engine_failure(error)
    lost = ExecutorLostError("executor e failed mid-stream: engine stopped")
    lost.__cause__ = engine_dead[0]  # the relay raises ExecutorLostError from the gRPC error
    assert is_engine_failure(lost)
    for error in (_rpc_error("Socket closed", None), _rpc_error("failed to connect to all addresses", None),
                  _rpc_error("executor e is draining", "DrainingError"),
                  _rpc_error("engine stopped", None),  # the words alone, from no Weft server
                  ExecutorLostError("engine thread died")):  # no gRPC error behind it
        assert not is_engine_failure(error)


def test_the_registry_is_bounded_in_count_and_age():
    now = [0.0]
    reg = SuspectRegistry(max_entries=2, ttl_s=10, clock=lambda: now[0])
    for rid in ("r1", "r2", "r3"):
        reg.add(rid, "why")
    assert reg.reason("r1") is None and reg.reason("r3") == "why"
    now[0] = 11
    assert reg.reason("r3") is None


def test_policy_rejects_a_zero_engine_failure_budget():
    with pytest.raises(ValueError, match="max_engine_failures"):
        MigrationPolicy(max_engine_failures=0)
