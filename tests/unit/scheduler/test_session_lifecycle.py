"""Session lifecycle at the scheduler (issue 17): one hop of a session at a time (a second
one is ABORTED naming the session and the running hop), ending a session releases its pins
on every executor and forgets its context at once (idempotent; another tenant's id is
NOT_FOUND and touches nothing), and a deterministic request is never served on a degraded
rung. Real in-process gRPC servers stand in for the scheduler's port and the executors."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.mesh.grpc_server import ErrorMappingInterceptor
from services.scheduler.agent_plane import AgentPlane
from services.scheduler.errors import ERROR_RULES
from services.scheduler.api.events import MeshView
from services.scheduler.api.executor_port import ChannelPool
from services.scheduler.api.servicer import SchedulerServicer, add_to_server
from services.scheduler.dispatch.agent_steps import AgentSteps
from services.scheduler.dispatch.degrade_steps import DegradeSteps
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.contracts import ContractBook
from services.scheduler.policy.degradation import DegradationLadder, LadderConfig, Rung, parse_thresholds
from services.scheduler.policy.pause import make_pause_policy
from services.scheduler.policy.placement import InflightTracker, PlacementPolicy, make_placer
from services.scheduler.policy.priority import make_prioritizer
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.sessions import SessionBusyError, SessionTable
from tests.unit.scheduler.test_placement_rungs import FakeExecutor, membership, record
from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


class GatedExecutor(FakeExecutor):
    """Sends one token, then waits for ``gate`` before the final one; records releases
    and the sampling each request arrived with."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate = asyncio.Event()
        self.released: list[str] = []
        self.samplings: list[common_pb2.SamplingParams] = []

    async def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        self.samplings.append(request.sampling)
        yield executor_pb2.ExecuteResponse(request_id=request.request_id, token_ids_delta=[7], executor=self.name)
        await self.gate.wait()
        yield executor_pb2.ExecuteResponse(
            request_id=request.request_id, token_ids_delta=[8], finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=2),
            executor=self.name)

    async def ReleaseSession(self, request, context):
        self.released.append(request.session_id)
        return executor_pb2.ReleaseSessionResponse()


async def start_mesh(fakes: dict[str, FakeExecutor], ladder: DegradationLadder | None = None,
                     rungs: dict[str, Rung] | None = None):
    """Executors on in-process servers and a scheduler (agent plane on) served over gRPC:
    (scheduler stub, async close, scheduler address)."""
    servers, records = [], []
    for name, fake in fakes.items():
        server = grpc.aio.server()
        executor_pb2_grpc.add_ExecutorServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        records.append(record(name, (rungs or {}).get(name, Rung.NONE), address=f"127.0.0.1:{port}"))
    view = MeshView(membership(*records), KvIndex())
    admission, inflight, port = Admission(8, 8), InflightTracker(), ChannelPool(1 << 20)
    plane = AgentPlane(make_prioritizer("weft"), make_pause_policy("keep"), ContractBook(), sessions=SessionTable())
    dispatcher = Dispatcher(view, make_placer(PlacementPolicy.KV), admission, port, degrade=DegradeSteps(ladder),
                            agent=AgentSteps(plane, view.membership, port, admission, inflight), inflight=inflight)
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(ERROR_RULES)])  # as the scheduler's app
    add_to_server(SchedulerServicer(dispatcher), server)
    sched_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    servers.append(server)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sched_port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def close():
        await channel.close()
        await port.close()
        for s in servers:
            await s.stop(0)
    return stub, close, f"127.0.0.1:{sched_port}"


def hop(rid: str, tenant: str = "t", session_id: str = "s", hop_index: int = 0, stateful: bool = False,
        request_class=common_pb2.REQUEST_CLASS_AGENTIC) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3], tenant=tenant, sampling=common_pb2.SamplingParams(max_tokens=2),
        session=common_pb2.SessionInfo(session_id=session_id, hop_index=hop_index, stateful=stateful,
                                       request_class=request_class))


async def run_hop(stub, request) -> list[scheduler_pb2.ScheduleResponse]:
    return [r async for r in stub.Generate(request)]


async def drain(call) -> list[scheduler_pb2.ScheduleResponse]:
    """The rest of a call already read from (gRPC forbids mixing read() and iteration)."""
    out = []
    while (resp := await call.read()) is not grpc.aio.EOF:
        out.append(resp)
    return out


def test_a_second_hop_while_one_runs_is_aborted_naming_both_and_the_next_hop_after_it_is_accepted():
    fake = GatedExecutor("e")

    async def main():
        stub, close, _ = await start_mesh({"e": fake})
        try:
            first = stub.Generate(hop("hop-a", hop_index=0))
            await first.read()  # hop-a runs
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await run_hop(stub, hop("hop-b", hop_index=0))
            other_session = stub.Generate(hop("other", session_id="s2"))
            await other_session.read()  # another session is not blocked
            fake.gate.set()
            rest = await drain(first)
            await drain(other_session)
            after = await run_hop(stub, hop("hop-c", hop_index=1, stateful=True))
            return busy.value, rest, after
        finally:
            await close()

    busy, rest, after = asyncio.run(main())
    assert busy.code() == grpc.StatusCode.ABORTED
    assert "'s'" in busy.details() and "hop-a" in busy.details()
    assert ("weft-error", "SessionBusyError") in tuple(busy.trailing_metadata())  # ERROR_RULES
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # the first hop was unaffected
    assert after[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert "hop-b" not in fake.request_ids


def test_ending_a_session_releases_it_on_every_executor_forgets_it_and_is_idempotent():
    fakes = {"e1": GatedExecutor("e1"), "e2": GatedExecutor("e2")}
    for f in fakes.values():
        f.gate.set()

    async def main():
        stub, close, _ = await start_mesh(fakes)
        try:
            await run_hop(stub, hop("h0"))
            first = await stub.EndSession(scheduler_pb2.SchedulerEndSessionRequest(tenant="t", session_id="s"))
            again = await stub.EndSession(scheduler_pb2.SchedulerEndSessionRequest(tenant="t", session_id="s"))
            with pytest.raises(grpc.aio.AioRpcError) as forgotten:  # its context is gone
                await run_hop(stub, hop("h1", hop_index=1, stateful=True))
            return first, again, forgotten.value
        finally:
            await close()

    first, again, forgotten = asyncio.run(main())
    assert (first.ended_now, first.num_executors_released, first.num_running_hops) == (True, 2, 0)
    assert (again.ended_now, again.num_executors_released) == (False, 2)
    assert fakes["e1"].released == fakes["e2"].released == ["t/s", "t/s"]
    assert forgotten.code() == grpc.StatusCode.INVALID_ARGUMENT and "session.session_id" in forgotten.details()


def test_another_tenants_session_id_is_not_found_and_touches_nothing():
    fake = GatedExecutor("e")
    fake.gate.set()

    async def main():
        stub, close, _ = await start_mesh({"e": fake})
        try:
            await run_hop(stub, hop("a0", tenant="a"))
            with pytest.raises(grpc.aio.AioRpcError) as theirs:
                await stub.EndSession(scheduler_pb2.SchedulerEndSessionRequest(tenant="b", session_id="s"))
            continued = await run_hop(stub, hop("a1", tenant="a", hop_index=1, stateful=True))
            return theirs.value, continued
        finally:
            await close()

    theirs, continued = asyncio.run(main())
    assert theirs.code() == grpc.StatusCode.NOT_FOUND
    assert fake.released == []
    assert continued[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # a's session lives on


def test_a_session_ended_while_its_hop_runs_is_released_after_the_hop_and_not_recorded():
    fake = GatedExecutor("e")

    async def main():
        stub, close, _ = await start_mesh({"e": fake})
        try:
            running = stub.Generate(hop("h0"))
            await running.read()
            end = await stub.EndSession(scheduler_pb2.SchedulerEndSessionRequest(tenant="t", session_id="s"))
            released_during = list(fake.released)
            fake.gate.set()
            await drain(running)
            for _ in range(200):  # the release after the hop is a background task: wait on it
                if len(fake.released) > len(released_during):
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as forgotten:
                await run_hop(stub, hop("h1", hop_index=1, stateful=True))
            return end, released_during, forgotten.value
        finally:
            await close()

    end, released_during, forgotten = asyncio.run(main())
    assert end.num_running_hops == 1
    assert released_during == ["t/s"]
    assert fake.released == ["t/s", "t/s"]  # again once the hop had pinned at its finish
    assert forgotten.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_deterministic_request_is_never_served_on_a_degraded_rung():
    fakes = {"full": GatedExecutor("full"), "int8": GatedExecutor("int8")}
    for f in fakes.values():
        f.gate.set()
    ladder = DegradationLadder(LadderConfig(enabled=frozenset({Rung.NONE, Rung.KV_INT8, Rung.SHED}),
                                            thresholds=parse_thresholds("kv_int8=0:0")))  # pinned on kv_int8

    async def main():
        stub, close, _ = await start_mesh(fakes, ladder, {"int8": Rung.KV_INT8})
        try:
            batch = await run_hop(stub, hop("b", session_id="", request_class=common_pb2.REQUEST_CLASS_BATCH))
            det = await run_hop(stub, hop("d", session_id="", request_class=common_pb2.REQUEST_CLASS_DETERMINISTIC))
            return batch, det
        finally:
            await close()

    batch, det = asyncio.run(main())
    assert batch[0].degradation_rung == common_pb2.DEGRADATION_RUNG_KV_INT8  # the ladder does degrade others
    assert (det[0].executor, det[0].degradation_rung) == ("full", common_pb2.DEGRADATION_RUNG_NONE)


def test_a_claim_is_per_tenant_and_session_and_released_only_by_its_holder():
    table = SessionTable()
    table.claim("a", "s", "r1")
    table.claim("b", "s", "r2")  # another tenant's same id is another session
    table.claim("a", "", "r3")  # session-less requests claim nothing
    with pytest.raises(SessionBusyError, match="r1"):
        table.claim("a", "s", "r4")
    table.release_claim("a", "s", "r4")  # not the holder: no effect
    assert table.running_hop("a", "s") == "r1"
    table.release_claim("a", "s", "r1")
    table.claim("a", "s", "r4")


def test_a_routers_continuation_of_the_running_hop_takes_its_claim_over():
    table = SessionTable()
    table.claim("a", "s", "hop-7")
    table.claim("a", "s", "hop-7.c1")  # the router resent the hop whose stream it lost
    assert table.running_hop("a", "s") == "hop-7.c1"
    table.release_claim("a", "s", "hop-7")  # the old stream's late end does not free it
    with pytest.raises(SessionBusyError):
        table.claim("a", "s", "hop-8")
    with pytest.raises(SessionBusyError):
        table.claim("a", "s", "hop-7x.c1")  # only the same hop's continuation
