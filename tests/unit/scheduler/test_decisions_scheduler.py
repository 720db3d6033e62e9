"""Decisions visible at the scheduler (issue 17), over real gRPC with fake executors: the
first chunk's ``decisions`` name the class, priority, queue time, rung, fallback and the
TTFT contract (estimate counting the placement's cached prefix, ceiling, observed TTFT),
the last chunk's the pause decision; the old flat fields stay filled; each decision is a
``scheduler.decision.*`` event in the trailers' timeline and moves its metric."""
from __future__ import annotations

import asyncio
import json

import grpc

from services.mesh import metrics
from services.mesh.grpc_server import ErrorMappingInterceptor
from services.mesh.timeline import SPANS_KEY
from services.scheduler.agent_plane import AgentPlane
from services.scheduler.api.events import MeshView
from services.scheduler.api.executor_port import ChannelPool
from services.scheduler.api.servicer import SchedulerServicer, add_to_server
from services.scheduler.dispatch.agent_steps import AgentSteps
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.scheduler.errors import ERROR_RULES
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.contracts import ContractBook
from services.scheduler.policy.intent_shift import IntentDistance, IntentShiftDetector
from services.scheduler.policy.pause import make_pause_policy
from services.scheduler.policy.placement import InflightTracker, PlacementPolicy, make_placer
from services.scheduler.policy.priority import make_prioritizer
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.sessions import SessionTable
from services.shared.block_hash import extra_keys_for, hash_block_chain
from tests.unit.scheduler.test_placement_rungs import FakeExecutor, membership, record
from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

PROMPT = list(range(1, 65))  # 4 blocks of 16


class SlowFirstToken(FakeExecutor):
    """A fake executor whose first token comes no sooner than ``delay_s`` after the call."""

    def __init__(self, name: str, delay_s: float = 0.0) -> None:
        super().__init__(name)
        self.delay_s = delay_s

    async def Generate(self, request, context):
        await asyncio.sleep(self.delay_s)  # a lower bound on the TTFT, not synchronisation
        async for msg in super().Generate(request, context):
            yield msg

    async def ReleaseSession(self, request, context):
        return executor_pb2.ReleaseSessionResponse()


class AlwaysFar(IntentDistance):
    name = "embedding"

    def distance(self, context_token_ids, turn_token_ids) -> float:
        return 0.95


async def start(executor: FakeExecutor, kv_index: KvIndex | None = None, intent: IntentShiftDetector | None = None):
    server = grpc.aio.server()
    executor_pb2_grpc.add_ExecutorServicer_to_server(executor, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    view = MeshView(membership(record(executor.name, address=f"127.0.0.1:{port}")), kv_index or KvIndex())
    admission, inflight, pool = Admission(8, 8), InflightTracker(), ChannelPool(1 << 20)
    plane = AgentPlane(make_prioritizer("weft"), make_pause_policy("keep"), ContractBook(), intent=intent,
                       sessions=SessionTable())
    dispatcher = Dispatcher(view, make_placer(PlacementPolicy.KV), admission, pool,
                            agent=AgentSteps(plane, view.membership, pool, admission, inflight), inflight=inflight)
    sched = grpc.aio.server(interceptors=[ErrorMappingInterceptor(ERROR_RULES)])
    add_to_server(SchedulerServicer(dispatcher), sched)
    sched_port = sched.add_insecure_port("127.0.0.1:0")
    await sched.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sched_port}")

    async def close():
        await channel.close()
        await pool.close()
        await sched.stop(0)
        await server.stop(0)
    return scheduler_pb2_grpc.SchedulerStub(channel), close


def request(rid: str, prompt=PROMPT, session_id: str = "", hop_index: int = 0, stateful: bool = False,
            request_class=common_pb2.REQUEST_CLASS_INTERACTIVE, **contract) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(
        request_id=rid, prompt_token_ids=prompt, tenant="t", model_id="m",
        sampling=common_pb2.SamplingParams(max_tokens=3),
        session=common_pb2.SessionInfo(session_id=session_id, hop_index=hop_index, stateful=stateful,
                                       request_class=request_class, contract=common_pb2.Contract(**contract)))


async def call(stub, req) -> tuple[list[scheduler_pb2.ScheduleResponse], list[dict]]:
    """The responses and the timeline spans from the call's trailers."""
    c = stub.Generate(req)
    out = [r async for r in c]
    spans = []
    for key, value in await c.trailing_metadata() or ():
        if key == SPANS_KEY:
            spans = json.loads(value)
    return out, spans


def events(spans: list[dict]) -> dict[str, dict]:
    return {s["name"].removeprefix("scheduler.decision."): s["attrs"] for s in spans
            if s["name"].startswith("scheduler.decision.")}


def sample(name: str, **labels) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_first_chunk_names_every_decision_and_the_last_the_pause_with_flat_fields_kept():
    async def main():
        stub, close = await start(SlowFirstToken("e"))
        try:
            return await call(stub, request("d-1", session_id="s", request_class=common_pb2.REQUEST_CLASS_AGENTIC,
                                            ttft_ceiling_ms=600_000))
        finally:
            await close()

    before = sample("weft_scheduler_ttft_ceiling_total", request_class="agentic", outcome="met")
    prio_before = sample("weft_scheduler_priority_count", request_class="agentic")
    out, spans = asyncio.run(main())
    first, last = out[0].decisions, out[-1].decisions
    assert first.request_class == common_pb2.REQUEST_CLASS_AGENTIC
    assert first.degradation_rung == common_pb2.DEGRADATION_RUNG_NONE
    assert first.ttft_ceiling_ms == 600_000
    assert 0 < first.ttft_estimate_ms  # 64 new tokens to prefill
    assert first.priority < 0  # agentic sits below interactive (0)
    assert first.pause_decision == common_pb2.PAUSE_DECISION_UNSPECIFIED  # the pause is the last chunk's
    assert last.pause_decision == common_pb2.PAUSE_DECISION_KEEP
    assert out[0].request_class == common_pb2.REQUEST_CLASS_AGENTIC  # compat: flat fields too
    assert out[-1].pause_decision == common_pb2.PAUSE_DECISION_KEEP
    ev = events(spans)
    assert {"admission", "rung", "ttft", "pause"} <= set(ev)
    assert ev["admission"]["request_class"] == "agentic"
    assert ev["ttft"]["outcome"] == "met" and ev["ttft"]["ceiling_ms"] == 600_000
    assert ev["pause"]["decision"] == "keep"
    assert sample("weft_scheduler_ttft_ceiling_total", request_class="agentic", outcome="met") == before + 1
    assert sample("weft_scheduler_priority_count", request_class="agentic") == prio_before + 1


def test_achieved_ttft_over_the_ceiling_is_reported_missed_with_a_fallback_decision():
    async def main():
        stub, close = await start(SlowFirstToken("e", delay_s=0.05))
        try:
            return await call(stub, request("d-2", ttft_ceiling_ms=1, fallback=common_pb2.FALLBACK_PATH_REROUTE))
        finally:
            await close()

    missed = sample("weft_scheduler_ttft_ceiling_total", request_class="interactive", outcome="missed")
    fallbacks = sample("weft_scheduler_fallbacks_total", path="reroute")
    out, spans = asyncio.run(main())
    d = out[0].decisions
    assert d.ttft_achieved_ms >= 50 > d.ttft_ceiling_ms == 1
    assert d.fallback_taken == common_pb2.FALLBACK_PATH_REROUTE and "ttft estimate" in d.fallback_reason
    assert events(spans)["ttft"]["outcome"] == "missed"
    assert events(spans)["fallback"]["path"] == "reroute"
    assert sample("weft_scheduler_ttft_ceiling_total", request_class="interactive", outcome="missed") == missed + 1
    assert sample("weft_scheduler_fallbacks_total", path="reroute") == fallbacks + 1
    assert sample("weft_scheduler_ttft_ceiling_ratio_count", request_class="interactive") >= 1


def test_ttft_estimate_counts_the_prefix_the_placement_expects_cached():
    cached_index = KvIndex()
    cached_index.stored("e", hash_block_chain(PROMPT, 16, extra_keys_for("m", "t"))[:3])  # 48 of 64 tokens

    async def main(index):
        stub, close = await start(SlowFirstToken("e"), kv_index=index)
        try:
            return (await call(stub, request("d-3", ttft_ceiling_ms=600_000)))[0][0].decisions
        finally:
            await close()

    cold, warm = asyncio.run(main(KvIndex())), asyncio.run(main(cached_index))
    assert cold.expected_cached_tokens == 0 and warm.expected_cached_tokens == 48
    # prefill_ms_per_token 0.2: 64 new tokens cold, 16 warm (the queueing part is the same)
    assert cold.ttft_estimate_ms - warm.ttft_estimate_ms == round(48 * 0.2)


def test_an_intent_shift_is_a_decision_an_event_and_a_count():
    async def main():
        stub, close = await start(SlowFirstToken("e"), intent=IntentShiftDetector(AlwaysFar(), 0.8))
        try:
            await call(stub, request("h-0", session_id="s", request_class=common_pb2.REQUEST_CLASS_AGENTIC))
            return await call(stub, request("h-1", prompt=list(range(100, 120)), session_id="s", hop_index=1,
                                            request_class=common_pb2.REQUEST_CLASS_AGENTIC))
        finally:
            await close()

    shifted = sample("weft_scheduler_intent_shift_total", decision="shifted")
    out, spans = asyncio.run(main())
    assert out[0].decisions.intent_shift
    assert events(spans)["intent_shift"]["decision"] == "shifted"
    assert sample("weft_scheduler_intent_shift_total", decision="shifted") == shifted + 1
