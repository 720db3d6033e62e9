"""Issue 17 (session 2), fork and join attacked by a hostile client: join from a grandchild,
a sibling, an ended child or itself is refused naming ``from``; a fork of a child mid-hop
is busy while its parent may still fork; a fork bomb (forks of forks) and a client that
then ends every session it knows leave no pin behind on any executor; a join followed by
ending the parent releases the absorbed child's pins too (they were left to their TTL),
but never those of a live child that took its id since; a tenant's forks cannot evict
another tenant's sessions from the scheduler's table (fixed: the table evicts the oldest
session of the tenant holding the most)."""
from __future__ import annotations

import asyncio

import grpc

from services.scheduler.state.sessions import SessionTable
from tests.unit.scheduler.test_session_fork import PARENT_PROMPT, Mesh, gated, hop, refused
from tests.unit.scheduler.test_session_lifecycle import GatedExecutor, drain, run_hop
from weft.v1 import common_pb2, scheduler_pb2


class PinningExecutor(GatedExecutor):
    """Also records the executor session ids it was asked to pin blocks for."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.pinned: set[str] = set()

    async def Generate(self, request, context):
        if request.pin_ttl_ms and request.session.session_id:
            self.pinned.add(request.session.session_id)
        async for chunk in super().Generate(request, context):
            yield chunk


def pinning(*names: str) -> dict[str, PinningExecutor]:
    fakes = {n: PinningExecutor(n) for n in names}
    for f in fakes.values():
        f.gate.set()
    return fakes


async def end(mesh: Mesh, session_id: str, tenant: str = "t"):
    return await mesh.stub.EndSession(scheduler_pb2.SchedulerEndSessionRequest(tenant=tenant, session_id=session_id))


def still_pinned(fakes) -> set[str]:
    """Session ids pinned on some executor and never released there."""
    return {sid for f in fakes.values() for sid in f.pinned if sid not in f.released}


def test_join_from_a_grandchild_a_sibling_an_ended_child_or_itself_is_refused_naming_from():
    async def main():
        async with Mesh(gated("a")) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            await mesh.fork(ids=["x", "y", "z"])
            await run_hop(mesh.stub, hop("x1", "x", 1, [5], stateful=True))
            await mesh.fork(session_id="x", ids=["x.g"])
            await end(mesh, "z")
            out = {"grandchild": await refused(mesh.join(from_id="x.g")),
                   "sibling": await refused(mesh.join(session_id="y", from_id="x")),
                   "ended": await refused(mesh.join(from_id="z")),
                   "itself": await refused(mesh.join(from_id="p"))}
            out["ok"] = await mesh.join(from_id="x", end_children=False)  # nothing above changed p
            return out

    out = asyncio.run(main())
    for case in ("grandchild", "sibling", "ended", "itself"):
        assert out[case].code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert out[case].details().startswith("from_session_id: "), (case, out[case].details())
    assert out["ok"].num_context_tokens == len(PARENT_PROMPT) + 2 + 3


def test_a_child_mid_hop_cannot_fork_but_its_parent_and_siblings_can():
    fakes = gated("a")

    async def main():
        async with Mesh(fakes) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            await mesh.fork(ids=["x", "y"])
            fakes["a"].gate.clear()
            running = mesh.stub.Generate(hop("x1", "x", 1, [5], stateful=True))
            await running.read()
            busy = await refused(mesh.fork(session_id="x", n=2))
            join_busy = await refused(mesh.join(from_id="x"))
            sibling = await mesh.fork(session_id="y", n=2)
            parent = await mesh.fork(ids=["w"])
            fakes["a"].gate.set()
            await drain(running)
            return busy, join_busy, sibling, parent

    busy, join_busy, sibling, parent = asyncio.run(main())
    assert busy.code() == join_busy.code() == grpc.StatusCode.ABORTED and "x1" in busy.details()
    assert list(sibling.child_session_ids) == ["y.f0", "y.f1"] and list(parent.child_session_ids) == ["w"]


def test_a_child_whose_stream_the_client_drops_frees_its_claim_and_its_parent_can_join_from_it():
    fakes = gated("a")

    async def main():
        async with Mesh(fakes) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            await mesh.fork(ids=["x"])
            fakes["a"].gate.clear()
            dropped = mesh.stub.Generate(hop("x1", "x", 1, [5], stateful=True))
            await dropped.read()
            dropped.cancel()  # the client disconnects mid-stream
            # The gate stays shut until the join: opened at once, the executor could finish
            # the hop before the cancellation reached the scheduler (CI, a loaded box), and a
            # finished hop is recorded.
            try:
                for _ in range(500):  # the claim goes when the scheduler sees the cancellation
                    try:
                        return await mesh.join(from_id="x")
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.ABORTED:
                            raise
                        await asyncio.sleep(0.01)
                raise AssertionError("the dropped child's claim was never released")
            finally:
                fakes["a"].gate.set()

    joined = asyncio.run(main())
    assert joined.num_context_tokens == len(PARENT_PROMPT) + 2  # the dropped hop was not recorded


def test_a_fork_bomb_ended_session_by_session_leaves_no_pin_on_any_executor():
    fakes = pinning("a", "b")

    async def main():
        async with Mesh(fakes) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            known, frontier, k = ["p"], ["p"], 0
            for depth in range(1, 3):  # two generations of forks of forks: 4 + 16 sessions
                nxt = []
                for sid in frontier:
                    children = list((await mesh.fork(session_id=sid, n=4)).child_session_ids)
                    for cid in children:
                        k += 1
                        await run_hop(mesh.stub, hop(f"h{k}", cid, depth, [900 + k], stateful=True))
                    nxt += children
                known += nxt
                frontier = nxt
            await mesh.join(from_id="p.f1")  # ends p.f0, p.f2, p.f3 (not their children)
            assert still_pinned(fakes)
            for sid in known:
                await end(mesh, sid)
            return known

    known = asyncio.run(main())
    assert len(known) == 21
    assert still_pinned(fakes) == set()


def test_ending_a_joined_parent_releases_the_pins_of_the_child_it_absorbed():
    fakes = pinning("a")

    async def main():
        async with Mesh(fakes) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            await mesh.fork(ids=["x"])
            await run_hop(mesh.stub, hop("x1", "x", 1, [5], stateful=True))
            await mesh.join(from_id="x")
            await end(mesh, "p")  # the client is done: it never named "x" again

    asyncio.run(main())
    assert still_pinned(fakes) == set()


def test_ending_a_joined_parent_leaves_a_live_child_that_reuses_an_absorbed_id_pinned():
    """A later fork's default ids reuse the absorbed child's (p.f0): that live child's pins
    are its own, and ending the parent leaves its children."""
    fakes = pinning("a")

    async def main():
        async with Mesh(fakes) as mesh:
            await run_hop(mesh.stub, hop("p0", "p", 0, PARENT_PROMPT))
            await mesh.fork(n=1)
            await run_hop(mesh.stub, hop("c1", "p.f0", 1, [5], stateful=True))
            await mesh.join(from_id="p.f0")
            again = await mesh.fork(n=1)
            await run_hop(mesh.stub, hop("c2", "p.f0", 2, [6], stateful=True))
            fakes["a"].released.clear()
            await end(mesh, "p")
            return again

    again = asyncio.run(main())
    assert list(again.child_session_ids) == ["p.f0"]
    assert fakes["a"].released == ["t/p"] and "t/p.f0" in still_pinned(fakes)


def test_one_tenants_fork_bomb_cannot_evict_another_tenants_session():
    table = SessionTable(max_sessions=64)
    for tenant, sid in (("victim", "v"), ("attacker", "p")):
        table.claim(tenant, sid, f"{tenant}/r0")
        table.end_hop(tenant, sid, "", 0, list(range(40)), [1], "e", 40, 0, 0.0)
        table.release_claim(tenant, sid, f"{tenant}/r0")
    refused_forks = 0
    for k in range(8):  # 8 x 16 children > the table
        try:
            table.fork("attacker", "p", [f"p.{k}.{i}" for i in range(16)])
        except Exception:  # a refusal (a per-tenant bound) is a fine answer too
            refused_forks += 1
    assert table.get("victim", "v") is not None
    ctx = table.begin_hop("victim", "v", "", 1, True, [7])
    assert ctx.session is not None and len(ctx.prompt_token_ids) == 42
