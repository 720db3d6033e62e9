"""The servicer hands the engine the wire's words unchanged: priority reads "higher runs
first" on both sides (no sign flip at the boundary), and a request is charged to the
partition ``partition_of`` names (services/shared/vocabulary.py)."""
from __future__ import annotations

import asyncio

from services.executor.server import ExecutorServicer
from services.executor.tiers.offload import DemoteOnFinish
from services.executor.tiers.tier_ops import TierOps
from weft.v1 import executor_pb2


class _RecordingEngine:
    """An AsyncEngine stand-in that records what the servicer asks of it."""

    def __init__(self) -> None:
        self.generated: dict[str, dict] = {}
        self.priorities: dict[str, float] = {}

    async def generate(self, request_id, prompt_token_ids, params, **kwargs):
        self.generated[request_id] = kwargs
        await asyncio.Event().wait()
        yield  # pragma: no cover

    def abort(self, request_id: str) -> None:
        pass

    async def call(self, fn):
        return fn(self)

    def update_priorities(self, priorities: dict[str, float]) -> int:
        self.priorities.update(priorities)
        return len(priorities)


class _Context:
    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None


async def _submit(servicer: ExecutorServicer, engine: _RecordingEngine, request) -> dict:
    stream = servicer.Generate(request, _Context())
    first = asyncio.ensure_future(anext(stream))
    for _ in range(100):  # until the pump handed the request over (no sleeps as sync)
        if request.request_id in engine.generated:
            break
        await asyncio.sleep(0)
    first.cancel()
    try:
        await first
    except asyncio.CancelledError:
        pass
    await stream.aclose()
    return engine.generated[request.request_id]


def test_generate_passes_the_wire_priority_and_the_shared_partition_to_the_engine():
    async def go():
        engine = _RecordingEngine()
        servicer = ExecutorServicer(engine, "executor-0", "tiny", 16)
        urgent = await _submit(servicer, engine, executor_pb2.ExecuteRequest(
            request_id="urgent", prompt_token_ids=[1, 2], priority=5.0, tenant_salt="acme"))
        assert urgent["priority"] == 5.0 and urgent["partition"] == "acme"
        named = await _submit(servicer, engine, executor_pb2.ExecuteRequest(
            request_id="named", prompt_token_ids=[1, 2], partition="gold", tenant_salt="acme"))
        assert named["partition"] == "gold"
        anon = await _submit(servicer, engine, executor_pb2.ExecuteRequest(request_id="anon", prompt_token_ids=[1]))
        assert anon["partition"] == "default" and anon["priority"] == 0.0

    asyncio.run(go())


def test_update_priorities_keeps_the_wire_sign():
    async def go():
        engine = _RecordingEngine()
        servicer = ExecutorServicer(engine, "executor-0", "tiny", 16)
        reply = await servicer.UpdatePriorities(
            executor_pb2.UpdatePrioritiesRequest(request_ids=["a", "b"], priorities=[3.0, -1.0]), None)
        assert reply.num_updated == 2 and engine.priorities == {"a": 3.0, "b": -1.0}

    asyncio.run(go())


def test_collaborators_are_constructor_arguments():
    tiers = TierOps(None, None, DemoteOnFinish.NEVER, promote_before_prefill=False)
    servicer = ExecutorServicer(_RecordingEngine(), "executor-0", "tiny", 16, tiers=tiers,
                                no_tiers_reason="unused")
    assert servicer.tiers is tiers
    bare = ExecutorServicer(_RecordingEngine(), "executor-0", "tiny", 16, no_tiers_reason="int8 cache")
    assert bare.tiers is None and bare.no_tiers_reason == "int8 cache"
