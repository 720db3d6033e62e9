"""Fork and join at the scheduler (issue 17), over gRPC with fake executors: a fork copies
an idle session's context into children whose stateful hops run in parallel (each its own
claim) and are placed on the executor holding the parent's blocks; a join continues the
parent from one child and ends the others (released on every executor). Refusals: a
running parent 409/ABORTED, an unknown or another tenant's session NOT_FOUND, a child id
in use ALREADY_EXISTS, bad counts / ids / ``from`` INVALID_ARGUMENT naming the field."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.mesh.grpc_server import ErrorMappingInterceptor
from services.scheduler.agent_plane import AgentPlane
from services.scheduler.api.events import MeshView
from services.scheduler.api.executor_port import ChannelPool
from services.scheduler.api.servicer import SchedulerServicer, add_to_server
from services.scheduler.dispatch.agent_steps import AgentSteps
from services.scheduler.dispatch.degrade_steps import DegradeSteps
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.scheduler.errors import ERROR_RULES
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.contracts import ContractBook
from services.scheduler.policy.pause import make_pause_policy
from services.scheduler.policy.placement import InflightTracker, PlacementPolicy, make_placer
from services.scheduler.policy.priority import make_prioritizer
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.sessions import SessionTable
from services.shared.block_hash import extra_keys_for, hash_block_chain
from tests.unit.scheduler.test_placement_rungs import membership, record
from tests.unit.scheduler.test_session_lifecycle import GatedExecutor, drain, run_hop
from weft.v1 import common_pb2, executor_pb2_grpc, router_pb2, scheduler_pb2, scheduler_pb2_grpc

PARENT_PROMPT = list(range(1, 161))  # 160 tokens: ten full 16-token blocks, each child adds one token
CONTEXT = len(PARENT_PROMPT) + 2  # + the fake executor's two output tokens


class Mesh:
    """Fake executors and a scheduler (agent plane on) over gRPC; ``index`` is its KV index."""

    def __init__(self, fakes: dict[str, GatedExecutor]) -> None:
        self.fakes = fakes

    async def __aenter__(self) -> Mesh:
        self.servers, records = [], []
        for name, fake in self.fakes.items():
            server = grpc.aio.server()
            executor_pb2_grpc.add_ExecutorServicer_to_server(fake, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            records.append(record(name, address=f"127.0.0.1:{port}"))
        view = MeshView(membership(*records), KvIndex())
        self.index = view.kv_index
        admission, inflight, self.port = Admission(16, 16), InflightTracker(), ChannelPool(1 << 20)
        plane = AgentPlane(make_prioritizer("weft"), make_pause_policy("keep"), ContractBook(), sessions=SessionTable())
        dispatcher = Dispatcher(view, make_placer(PlacementPolicy.KV), admission, self.port,
                                degrade=DegradeSteps(None), inflight=inflight,
                                agent=AgentSteps(plane, view.membership, self.port, admission, inflight))
        server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(ERROR_RULES)])
        add_to_server(SchedulerServicer(dispatcher), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.servers.append(server)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.port.close()
        for s in self.servers:
            await s.stop(0)

    def holds(self, executor: str, token_ids: list[int], tenant: str = "t") -> None:
        """``executor`` reports these tokens' blocks (as its KV events would)."""
        self.index.stored(executor, hash_block_chain(token_ids, 16, extra_keys_for("m", tenant)))

    async def fork(self, session_id: str = "p", n: int = 0, ids=(), tenant: str = "t", fork_id: str = ""):
        return (await self.stub.ForkSession(scheduler_pb2.SchedulerForkSessionRequest(
            tenant=tenant, fork=router_pb2.ForkSessionRequest(session_id=session_id, num_children=n,
                                                              child_session_ids=list(ids)), fork_id=fork_id))).fork

    async def end(self, session_id: str, fork_id: str = "", tenant: str = "t"):
        return await self.stub.EndSession(scheduler_pb2.SchedulerEndSessionRequest(
            tenant=tenant, session_id=session_id, fork_id=fork_id))

    async def join(self, session_id: str = "p", from_id: str = "", end_children: bool = True, tenant: str = "t"):
        return (await self.stub.JoinSession(scheduler_pb2.SchedulerJoinSessionRequest(
            tenant=tenant, join=router_pb2.JoinSessionRequest(session_id=session_id, from_session_id=from_id,
                                                              end_children=end_children)))).join


def hop(rid: str, session_id: str, hop_index: int, prompt: list[int], stateful: bool = False, tenant: str = "t"):
    return scheduler_pb2.ScheduleRequest(
        request_id=rid, prompt_token_ids=prompt, tenant=tenant, sampling=common_pb2.SamplingParams(max_tokens=2),
        session=common_pb2.SessionInfo(session_id=session_id, hop_index=hop_index, stateful=stateful,
                                       request_class=common_pb2.REQUEST_CLASS_AGENTIC))


def gated(*names: str, open_: bool = True) -> dict[str, GatedExecutor]:
    fakes = {n: GatedExecutor(n) for n in names}
    for f in fakes.values():
        if open_:
            f.gate.set()
    return fakes


async def refused(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value


def test_children_run_in_parallel_on_the_executor_holding_the_parents_blocks():
    fakes = gated("a", "b", open_=False)

    async def main():
        async with Mesh(fakes) as mesh:
            fakes["b"].gate.set()
            fakes["a"].gate.set()
            parent = await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            served = parent[0].executor
            mesh.holds(served, PARENT_PROMPT)  # its KV event
            fork = await mesh.fork(n=3)
            for f in fakes.values():
                f.gate.clear()
            calls = [mesh.stub.Generate(hop(f"c{k}", cid, 1, [100 + k], stateful=True))
                     for k, cid in enumerate(fork.child_session_ids)]
            firsts = [await c.read() for c in calls]  # all three run at once: none was refused busy
            fakes[served].gate.set()
            rests = [await drain(c) for c in calls]
            return served, fork, firsts, rests

    served, fork, firsts, rests = asyncio.run(main())
    assert list(fork.child_session_ids) == ["p.f0", "p.f1", "p.f2"]
    assert fork.num_context_tokens == CONTEXT
    assert {f.executor for f in firsts} == {served}  # placed by the overlap with the parent's blocks
    assert all(r[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH for r in rests)
    # Each child's prompt is the parent's context + its own new token (stateful).
    children = [r for r in fakes[served].request_ids if r.startswith("c")]
    assert sorted(children) == ["c0", "c1", "c2"]


def test_join_continues_from_a_child_and_ends_the_others_on_every_executor():
    fakes = gated("a", "b")

    async def main():
        async with Mesh(fakes) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            fork = await mesh.fork(ids=["x", "y"])
            await run_hop(mesh.stub, hop("x1", "x", 1, [500], stateful=True))
            await run_hop(mesh.stub, hop("x2", "x", 2, [501], stateful=True))
            joined = await mesh.join(from_id="x")
            next_hop = await run_hop(mesh.stub, hop("p3", "p", 3, [600], stateful=True))  # x's hop index continues
            gone = await refused(run_hop(mesh.stub, hop("y1", "y", 1, [700], stateful=True)))
            absorbed = await refused(run_hop(mesh.stub, hop("x3", "x", 3, [700], stateful=True)))
            return fork, joined, next_hop, gone, absorbed

    fork, joined, next_hop, gone, absorbed = asyncio.run(main())
    # x: +1 new token +2 output, twice; the joined parent continues from x's context.
    assert fork.num_context_tokens == CONTEXT and joined.num_context_tokens == CONTEXT + 6
    assert list(joined.ended_session_ids) == ["y"]
    assert next_hop[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    for f in fakes.values():
        assert f.released == ["t/y"]  # y released everywhere; x's pins stay for the parent's next hop
    assert gone.code() == absorbed.code() == grpc.StatusCode.INVALID_ARGUMENT  # both forgotten
    assert "session.session_id" in gone.details()


def test_an_end_naming_a_fork_ends_only_the_sessions_that_fork_created():
    fakes = gated("a", "b")

    async def main():
        async with Mesh(fakes) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            await run_hop(mesh.stub, hop("z0", "z", 0, [9, 9]))  # the client's own session
            await mesh.fork(ids=["x", "y"], fork_id="F")
            other = await mesh.end("x", fork_id="G")  # another fork's id: x is left as it is
            own = await mesh.end("z", fork_id="F")  # not created by any fork
            released = [list(f.released) for f in fakes.values()]
            created = await mesh.end("x", fork_id="F")
            again = await mesh.end("x", fork_id="F")  # ended: no longer "created by F"
            hop1 = await run_hop(mesh.stub, hop("y1", "y", 1, [700], stateful=True))  # y lives on
            return other, own, released, created, again, hop1

    other, own, released, created, again, hop1 = asyncio.run(main())
    assert (other.ended_now, other.num_executors_released) == (False, 0)
    assert (own.ended_now, own.num_executors_released) == (False, 0)
    assert released == [[], []]
    assert (created.ended_now, created.num_executors_released) == (True, 2)
    assert all(f.released == ["t/x"] for f in fakes.values())
    assert not again.ended_now
    assert hop1[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_session_joined_from_a_child_every_hop_keeps_one_absorbed_id_and_releases_the_older():
    fakes = gated("a")

    async def main():
        async with Mesh(fakes) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            for k in (1, 2, 3):
                await mesh.fork(ids=[f"b{k}"])
                await run_hop(mesh.stub, hop(f"b{k}", f"b{k}", k, [500 + k], stateful=True))
                await mesh.join(from_id=f"b{k}")
            released = list(fakes["a"].released)
            await mesh.end("p")
            return released, list(fakes["a"].released)

    after_joins, after_end = asyncio.run(main())
    assert after_joins == ["t/b1", "t/b2"]  # each join released the one before (its pins are superseded)
    assert after_end == after_joins + ["t/p", "t/b3"]  # the end releases the session and the last absorbed


def test_join_without_from_keeps_the_parents_context_and_hop_index():
    async def main():
        async with Mesh(gated("a")) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            await mesh.fork(n=2)
            await run_hop(mesh.stub, hop("f1", "p.f0", 1, [9], stateful=True))
            joined = await mesh.join()
            after = await run_hop(mesh.stub, hop("p1", "p", 1, [10], stateful=True))
            return joined, after

    joined, after = asyncio.run(main())
    assert joined.num_context_tokens == CONTEXT and sorted(joined.ended_session_ids) == ["p.f0", "p.f1"]
    assert after[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_fork_of_a_running_session_is_aborted_and_creates_nothing():
    fakes = gated("a")

    async def main():
        async with Mesh(fakes) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            fakes["a"].gate.clear()
            running = mesh.stub.Generate(hop("p1", "p", 1, [5], stateful=True))
            await running.read()
            busy = await refused(mesh.fork(n=2))
            join_busy = await refused(mesh.join())
            fakes["a"].gate.set()
            await drain(running)
            after = await mesh.fork(n=2)  # nothing was created by the refused fork
            return busy, join_busy, after

    busy, join_busy, after = asyncio.run(main())
    assert busy.code() == join_busy.code() == grpc.StatusCode.ABORTED
    assert ("weft-error", "SessionBusyError") in tuple(busy.trailing_metadata())
    assert "p1" in busy.details()
    assert list(after.child_session_ids) == ["p.f0", "p.f1"] and after.num_context_tokens == CONTEXT + 3


def test_refusals_name_the_field_and_never_cross_tenants():
    async def main():
        async with Mesh(gated("a")) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            await run_hop(mesh.stub, hop("o0", "other", 0, [1, 2]))
            out = {
                "unknown": await refused(mesh.fork(session_id="nope", n=1)),
                "their": await refused(mesh.fork(tenant="u", n=1)),
                "their_join": await refused(mesh.join(tenant="u")),
                "zero": await refused(mesh.fork(n=0)),
                "many": await refused(mesh.fork(n=17)),
                "dup": await refused(mesh.fork(ids=["k", "k"])),
                "self": await refused(mesh.fork(ids=["k", "p"])),
                "exists": await refused(mesh.fork(ids=["k", "other"])),
            }
            out["from"] = await refused(mesh.join(from_id="other"))  # a session, but not p's child
            out["after"] = await mesh.fork(ids=["k"])  # the refused forks created no "k"
            return out

    out = asyncio.run(main())
    for key in ("unknown", "their", "their_join"):
        assert out[key].code() == grpc.StatusCode.NOT_FOUND, key
    assert out["exists"].code() == grpc.StatusCode.ALREADY_EXISTS and "'other'" in out["exists"].details()
    for key, field in (("zero", "num_children"), ("many", "num_children"), ("dup", "child_session_ids[1]"),
                       ("self", "child_session_ids[1]"), ("from", "from_session_id")):
        assert out[key].code() == grpc.StatusCode.INVALID_ARGUMENT, key
        assert out[key].details().startswith(f"{field}: "), (key, out[key].details())
    assert list(out["after"].child_session_ids) == ["k"]


def test_the_executor_whose_used_blocks_are_the_prompts_pinned_prefix_wins():
    """The parent's pins count as used blocks on its executor; a child reads them by
    reference, so they are no load against it (they made the other executor win)."""
    from services.scheduler.policy.placement import Candidate, KvAwarePlacer

    def cand(name: str, matched: int, used: int) -> Candidate:
        return Candidate(name, f"{name}:1", num_prompt_blocks=14, num_matched_blocks=matched, num_used_blocks=used,
                         num_blocks=100, num_active_requests=0, max_num_seqs=8)

    assert KvAwarePlacer().rank([cand("holder", 13, 16), cand("idle", 0, 0)])[0].name == "holder"
