"""Placement by degradation rung: executors announce the rung their pool serves, the
scheduler offers the ladder only those rungs, places a request served on rung R only on
executors serving R (full-quality requests never land on a degraded pool), and reads KV
use of the full-quality pool as load. In-process gRPC fakes stand in for executors."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.executor.events import ExecutorState as ExecState, Heartbeat, Identity
from services.executor.event_codec import encode_event
from services.mesh.nats_bus import Delivery
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.degradation import DegradationLadder, LadderConfig, Rung, parse_thresholds
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import ExecutorLoad, ExecutorRecord, ExecutorState, Membership
from services.scheduler.policy.placement import PlacementPolicy, make_placer
from services.scheduler.api.events import MeshView
from services.scheduler.api.executor_port import ChannelPool
from services.scheduler.api.servicer import SchedulerServicer
from services.scheduler.dispatch.degrade_steps import DegradeSteps
from services.scheduler.dispatch.dispatcher import Dispatcher
from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc, scheduler_pb2


def record(name: str, rung: Rung = Rung.NONE, state=ExecutorState.SERVING, load: ExecutorLoad | None = None,
           address: str = "") -> ExecutorRecord:
    return ExecutorRecord(name=name, address=address or f"{name}:1", model_id="m", block_size=16, state=state,
                          num_blocks=100, load=load, serves_rung=rung)


def membership(*records: ExecutorRecord) -> Membership:
    m = Membership()
    for r in records:
        m.heartbeat(r)
        if r.load is not None:
            m.update_load(r.name, r.load)
    return m


def test_only_live_executors_offer_their_rung():
    m = membership(record("full"), record("int8", Rung.KV_INT8),
                   record("compress", Rung.KV_COMPRESS, state=ExecutorState.DRAINING))
    assert m.offered_rungs() == {Rung.NONE, Rung.KV_INT8}
    assert [r.name for r in m.placeable(rung=Rung.KV_INT8)] == ["int8"]
    assert [r.name for r in m.placeable(rung=Rung.NONE)] == ["full"]
    assert m.placeable(rung=Rung.KV_COMPRESS) == []  # draining: takes no new work


def test_kv_load_is_measured_over_the_full_quality_pool_only():
    m = membership(record("a", load=ExecutorLoad(num_free_blocks=10, num_blocks=100)),
                   record("b", load=ExecutorLoad(num_free_blocks=70, num_blocks=100)),
                   record("int8", Rung.KV_INT8, load=ExecutorLoad(num_free_blocks=0, num_blocks=400)),
                   record("silent"))
    assert m.kv_used_fraction() == pytest.approx(120 / 200)
    assert Membership().kv_used_fraction() == 0.0


def test_the_servicer_ranks_only_executors_serving_the_requests_rung():
    view = MeshView(membership(record("full-a"), record("full-b"), record("int8", Rung.KV_INT8)), KvIndex())
    dispatcher = Dispatcher(view, make_placer(PlacementPolicy.KV), Admission(4, 4), ChannelPool(1 << 20))
    assert {p.name for p in dispatcher.rank("m", "t", list(range(40)))} == {"full-a", "full-b"}
    assert [p.name for p in dispatcher.rank("m", "t", list(range(40)), Rung.KV_INT8)] == ["int8"]
    assert dispatcher.rank("m", "t", list(range(40)), Rung.KV_COMPRESS) == []


def test_an_int8_executor_is_ranked_by_its_own_int8_salted_block_hashes():
    from services.shared.block_hash import extra_keys_for, hash_block_chain

    prompt = list(range(40))
    int8 = ExecutorRecord(name="int8", address="int8:1", model_id="m", block_size=16, state=ExecutorState.SERVING,
                          num_blocks=100, serves_rung=Rung.KV_INT8, kv_cache_dtype="int8")
    index = KvIndex()
    # what the int8 executor itself stores for this prompt: hashes salted with its cache dtype
    index.stored("int8", hash_block_chain(prompt, 16, extra_keys_for("m", "t", "int8")))
    dispatcher = Dispatcher(MeshView(membership(int8), index), make_placer(PlacementPolicy.KV),
                            Admission(4, 4), ChannelPool(1 << 20))
    [placement] = dispatcher.rank("m", "t", prompt, Rung.KV_INT8)
    assert placement.num_matched_blocks == 2


def test_a_heartbeat_carries_the_kv_cache_dtype_into_membership():
    view = MeshView(Membership(), KvIndex())
    msg = encode_event(Heartbeat(Identity("q", "q:1", "m", 16, 8, serves_rung="kv_int8", kv_cache_dtype="int8"),
                                 ExecState.SERVING, 1.0))
    msg.header.source = "q"
    view.on_heartbeat(msg, Delivery.FIRST)
    assert view.membership.get("q").kv_cache_dtype == "int8"


def test_a_heartbeat_carries_the_rung_the_executor_serves_into_membership():
    view = MeshView(Membership(), KvIndex())
    for name, rung in (("plain", "none"), ("int8", "kv_int8")):
        msg = encode_event(Heartbeat(Identity(name, f"{name}:1", "m", 16, 8, serves_rung=rung), ExecState.SERVING, 1.0))
        msg.header.source = name
        view.on_heartbeat(msg, Delivery.FIRST)
    old = encode_event(Heartbeat(Identity("old", "old:1", "m", 16, 8), ExecState.SERVING, 1.0))
    old.ClearField("serves_rung")  # an executor from before the field existed
    view.on_heartbeat(old, Delivery.FIRST)
    rungs = {r.name: r.serves_rung for r in view.membership.all()}
    assert rungs == {"plain": Rung.NONE, "int8": Rung.KV_INT8, "old": Rung.NONE}


class FakeExecutor(executor_pb2_grpc.ExecutorServicer):
    """Answers a Generate with ``max_tokens`` tokens (the last one final), naming itself;
    with ``die_after`` it fails UNAVAILABLE after that many tokens instead."""

    def __init__(self, name: str, die_after: int | None = None) -> None:
        self.name = name
        self.die_after = die_after
        self.request_ids: list[str] = []

    async def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        n = request.sampling.max_tokens or 1
        for i in range(1, n + 1):
            if self.die_after is not None and i > self.die_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "executor died")
            yield executor_pb2.ExecuteResponse(
                request_id=request.request_id, token_ids_delta=[7],
                finish_reason=common_pb2.FINISH_REASON_LENGTH if i == n else 0,
                usage=common_pb2.Usage(num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=i),
                executor=self.name)


class Context:
    def time_remaining(self):
        return 10.0

    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, md):
        pass


async def start_pools(fakes: dict[str, tuple[FakeExecutor, Rung]]):
    """In-process gRPC servers for ``fakes`` and a servicer whose ladder is pinned on kv_int8."""
    servers, records = [], []
    for name, (fake, rung) in fakes.items():
        server = grpc.aio.server()
        executor_pb2_grpc.add_ExecutorServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        records.append(record(name, rung, address=f"127.0.0.1:{port}"))
    ladder = DegradationLadder(LadderConfig(enabled=frozenset({Rung.NONE, Rung.KV_INT8, Rung.SHED}),
                                            thresholds=parse_thresholds("kv_int8=0:0")))  # pinned on kv_int8
    view = MeshView(membership(*records), KvIndex())
    servicer = SchedulerServicer(Dispatcher(view, make_placer(PlacementPolicy.KV), Admission(4, 4),
                                            ChannelPool(1 << 20), degrade=DegradeSteps(ladder)))
    return servicer, servers


def schedule_request(rid: str, steps=(), max_tokens: int = 1) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3], tenant="t", sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
        session=common_pb2.SessionInfo(request_class=common_pb2.REQUEST_CLASS_BATCH,
                                       contract=common_pb2.Contract(accepted_degrade_steps=steps)))


def test_requests_reach_the_pool_of_the_rung_they_are_served_on_and_say_which():
    fakes = {"full": (FakeExecutor("full"), Rung.NONE), "int8": (FakeExecutor("int8"), Rung.KV_INT8)}

    async def main():
        servicer, servers = await start_pools(fakes)

        async def generate(rid: str, steps=()) -> scheduler_pb2.ScheduleResponse:
            return [c async for c in servicer.Generate(schedule_request(rid, steps), Context())][0]

        try:
            degraded = await generate("r-any")
            full = await generate("r-full-only", [common_pb2.DEGRADE_STEP_NONE])
            compress_only = await generate("r-compress", [common_pb2.DEGRADE_STEP_KV_COMPRESS])
            servicer.dispatch.view.membership.remove("int8")  # the degraded pool is gone
            after = await generate("r-after")
        finally:
            for server in servers:
                await server.stop(0)
            await servicer.dispatch.port.close()
        return degraded, full, compress_only, after

    degraded, full, compress_only, after = asyncio.run(main())
    assert (degraded.executor, degraded.degradation_rung) == ("int8", common_pb2.DEGRADATION_RUNG_KV_INT8)
    for resp in (full, compress_only, after):
        assert (resp.executor, resp.degradation_rung) == ("full", common_pb2.DEGRADATION_RUNG_NONE)
    assert fakes["int8"][0].request_ids == ["r-any"]
    assert fakes["full"][0].request_ids == ["r-full-only", "r-compress", "r-after"]


def test_a_degraded_stream_whose_pool_dies_finishes_on_a_full_quality_executor():
    fakes = {"full": (FakeExecutor("full"), Rung.NONE), "int8": (FakeExecutor("int8", die_after=2), Rung.KV_INT8)}

    async def main():
        servicer, servers = await start_pools(fakes)
        try:
            return [c async for c in servicer.Generate(schedule_request("r", max_tokens=5), Context())]
        finally:
            for server in servers:
                await server.stop(0)
            await servicer.dispatch.port.close()

    chunks = asyncio.run(main())
    assert [c.executor for c in chunks] == ["int8", "int8", "full", "full", "full"]
    assert chunks[0].degradation_rung == common_pb2.DEGRADATION_RUNG_KV_INT8
    assert sum(len(c.token_ids_delta) for c in chunks) == 5 and chunks[-1].num_migrations == 1
