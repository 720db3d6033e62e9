"""Issue 17, a hostile client and an unlucky operator against ``n > 1`` on a session hop
(choice i >= 1 on the branch ``<session_id>.h<hop_index>.n<i>``, created first, all or
nothing, by ``Scheduler.ForkSession`` with ``or_new``), past what
test_issue17_session_hop_branch_ids.py and test_issue17_session_hop_choices.py cover: a fork
whose answer never reaches the router, a stateful hop with no context next to a session
named like its branch, the uint32 edge of hop_index, joins from hop-0 branches, a parent's
child list after LRU eviction, a session joined from a branch on every hop, ending the parent,
and malformed ``or_new`` requests straight at the scheduler servicer."""
from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import grpc
import pytest

from services.router.errors import SessionExistsError as BranchInUse
from services.router.errors import UpstreamUnavailable
from services.scheduler.api.servicer import SchedulerServicer
from services.scheduler.dispatch.agent_steps import AgentSteps
from services.scheduler.errors import InvalidScheduleRequest, SessionExistsError
from services.scheduler.state.sessions import SessionTable
from tests.adversarial import test_issue17_session_hop_choices as choices_module
from tests.adversarial.test_issue17_session_hop_choices import (A, BRANCHES_H1, TENANT_A, HostileExecutor, completion,
                                                                grpc_hop, mesh_doors, sessions_of)
from tests.unit.router.test_session_lifecycle_doors import grpc_key
from tests.waiting import until
from weft.v1 import executor_pb2, router_pb2, scheduler_pb2


@pytest.fixture
def model_dir(tiny_model_dir):
    return tiny_model_dir  # the suite's tiny checkpoint (tests/adversarial/conftest.py)


def hop(table: SessionTable, sid: str, index: int, tenant: str = "t", prompt=(1, 2, 3)) -> None:
    table.begin_hop(tenant, sid, "", index, False, list(prompt))
    table.end_hop(tenant, sid, "", index, list(prompt), [4], "e", len(prompt), 0, 0.0)


# -- a fork whose answer the router never gets ------------------------------------------------

class LostForks:
    """The scheduler client, whose first ForkSession reaches the scheduler (the branches are
    created) but whose answer is lost: the router sees the call fail as a deadline would."""

    def __init__(self, client) -> None:
        self.client, self.lose, self.created = client, True, ()

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def fork_session(self, tenant, session_id, child_ids, or_new=None, *, fork_id=""):
        forked = await self.client.fork_session(tenant, session_id, child_ids, or_new, fork_id=fork_id)
        if self.lose:
            self.lose, self.created = False, forked.child_session_ids
            raise UpstreamUnavailable("scheduler: DEADLINE_EXCEEDED: Deadline Exceeded", lost=True)
        return forked


@pytest.mark.parametrize("hop_index", [0, 1])
def test_a_fork_whose_answer_is_lost_leaves_no_branch_and_the_same_hop_can_be_asked_again(
        model_dir, monkeypatch, hop_index):
    branches = [f"s.h{hop_index}.n1", f"s.h{hop_index}.n2"]
    forks = []

    async def main():
        async with mesh_doors(model_dir, monkeypatch, lambda c: forks.append(LostForks(c)) or forks[-1]) as mesh:
            if hop_index:
                await mesh.post(completion(0, "s"))  # plain hop 0: no fork
            forks[0].lose = True
            lost = await mesh.post(completion(hop_index, "s", n=3))
            created = list(forks[0].created)  # the scheduler did create them
            await until(lambda: not mesh.left_behind(branches), "the branches of the failed hop to end", 5.0)
            return lost, created, await mesh.post(completion(hop_index, "s", n=3))

    lost, created, again = asyncio.run(main())
    assert lost[0] == 503, lost
    assert created == branches
    assert again[0] == 200 and sessions_of(again[1]) == ["s", *branches], again


class RefusedThenLostForks(LostForks):
    """The scheduler refuses the fork (a branch id is the client's own session), and the
    refusal is lost on the way back: the router sees the same failure as a lost success."""

    async def fork_session(self, tenant, session_id, child_ids, or_new=None, *, fork_id=""):
        try:
            return await self.client.fork_session(tenant, session_id, child_ids, or_new, fork_id=fork_id)
        except BranchInUse:
            raise UpstreamUnavailable("scheduler: DEADLINE_EXCEEDED: Deadline Exceeded", lost=True) from None


def test_a_lost_fork_answer_never_ends_the_clients_own_session_named_like_a_branch(model_dir, monkeypatch):
    async def main():
        async with mesh_doors(model_dir, monkeypatch, RefusedThenLostForks) as mesh:
            await mesh.post(completion(0, "s"))
            for h in (0, 1):  # the client's own session, named like hop 1's first branch
                await mesh.post(completion(h, "s.h1.n1", prompt=[7, 7, 7]))
            lost = await mesh.post(completion(1, "s", n=3))
            own = mesh.table.get(TENANT_A, "s.h1.n1")
            return lost, (own.last_hop, own.parent_id) if own else None, mesh.left_behind(["s.h1.n2"])

    lost, own, behind = asyncio.run(main())
    assert lost[0] == 503, lost
    assert own == (1, "")  # its session is untouched: the router's ends name the fork, which created nothing
    assert behind == []


class StuckForks:
    """The scheduler client; after a fork has reached the scheduler, its answer hangs until
    the request is cancelled (records that it was)."""

    def __init__(self, client) -> None:
        self.client = client
        self.forked, self.cancelled = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def fork_session(self, tenant, session_id, child_ids, or_new=None, *, fork_id=""):
        forked = await self.client.fork_session(tenant, session_id, child_ids, or_new, fork_id=fork_id)
        self.forked.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return forked  # pragma: no cover


def test_a_grpc_client_that_cancels_during_the_fork_leaves_no_branch(model_dir, monkeypatch):
    forks = []

    async def main():
        async with mesh_doors(model_dir, monkeypatch, lambda c: forks.append(StuckForks(c)) or forks[-1]) as mesh:
            await mesh.post(completion(0, "s"))
            call = mesh.grpc.Generate(grpc_hop(1, n=3), metadata=grpc_key("sk-a"))
            reader = asyncio.ensure_future(call.read())
            await forks[0].forked.wait()
            call.cancel()
            await asyncio.wait_for(forks[0].cancelled.wait(), 30)  # a guard, not a synchronisation
            reader.cancel()
            await until(lambda: not mesh.left_behind(["s.h1.n1", "s.h1.n2"]), "the branches to end", 5.0)
            forks[0].forked.clear()
            return "ended"

    assert asyncio.run(main()) == "ended"


# -- a stateful hop with no context; the uint32 edge of hop_index --------------------------------

def test_a_stateful_hop_with_n_and_no_context_is_refused_and_never_runs_on_a_session_named_like_its_branch(
        model_dir, monkeypatch):
    """As after a scheduler restart: "r" is unknown, the client has its own "r.h3.n1" expecting
    hop 3. The stateful hop forks nothing (NOT_FOUND), so its branch would run on the client's
    session of that name; choice 0's refusal must come first and touch nothing."""
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            for h in (0, 1, 2):
                await mesh.post(completion(h, "r.h3.n1", prompt=[7, 7, 7, 7]))
            before = mesh.table.get(TENANT_A, "r.h3.n1")
            before = (before.last_hop, before.context_token_ids.tolist())
            refused = await mesh.post(completion(3, "r", n=3, prompt=[5], session_stateful=True))
            after = mesh.table.get(TENANT_A, "r.h3.n1")
            return refused, before, (after.last_hop, after.context_token_ids.tolist()), mesh.left_behind(
                ["r", "r.h3.n2"]), mesh.table.running_hop(TENANT_A, "r.h3.n1")

    refused, before, after, behind, running = asyncio.run(main())
    assert refused[0] == 400 and refused[1]["error"]["param"] == "session.session_id", refused
    assert after == before and before[0] == 2
    assert behind == [] and running is None


def test_hop_index_at_the_uint32_edge_forks_its_branches_and_past_it_is_400_creating_nothing(
        model_dir, monkeypatch):
    edge = 2**32 - 1

    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            served = await mesh.post(completion(edge, "s", n=2))
            branch = mesh.table.get(TENANT_A, f"s.h{edge}.n1")
            past = [await mesh.post(completion(h, "u", n=2)) for h in (2**32, 2**63, -1)]
            return served, branch.last_hop, past, mesh.left_behind(["u", "u.h4294967296.n1", "u.h-1.n1"])

    served, branch_hop, past, behind = asyncio.run(main())
    assert served[0] == 200 and sessions_of(served[1]) == ["s", f"s.h{edge}.n1"], served
    assert branch_hop == edge
    assert [p[0] for p in past] == [400, 400, 400]
    assert all(p[1]["error"]["param"] == "hop_index" for p in past), past
    assert behind == []


# -- join, eviction, ending the parent (SessionTable) ---------------------------------------------

def test_join_from_a_hop_0_branch_is_refused_naming_from_and_changes_nothing():
    table = SessionTable()
    table.fork_or_new("t", "s", ["s.h0.n1"], "s", 0)  # hop 0: a new session, not a child
    hop(table, "s", 0)
    hop(table, "s.h0.n1", 0, prompt=(1, 2, 3, 9))
    with pytest.raises(InvalidScheduleRequest) as exc:
        table.join("t", "s", "s.h0.n1", end_children=True)
    assert exc.value.field == "from_session_id" and "not a live child" in str(exc.value)
    s, branch = table.get("t", "s"), table.get("t", "s.h0.n1")
    assert (s.last_hop, s.context_token_ids.tolist(), s.absorbed_ids) == (0, [1, 2, 3, 4], [])
    assert (branch.last_hop, branch.context_token_ids.tolist()) == (0, [1, 2, 3, 9, 4])
    assert not table.was_ended("t", "s.h0.n1")


def test_join_with_end_children_spares_a_session_that_reuses_an_evicted_branch_id():
    table = SessionTable(max_sessions=3)
    hop(table, "s", 0)
    table.fork_or_new("t", "s", ["s.h1.n1"], "s", 1)  # a fork: "s.h1.n1" is s's child
    hop(table, "x", 0)
    hop(table, "s", 1)  # choice 0's hop: "s" is the newest again
    hop(table, "y", 0)  # the bound evicts the tenant's oldest: the branch
    assert table.get("t", "s.h1.n1") is None and table.get("t", "s").child_ids == ["s.h1.n1"]
    hop(table, "s.h1.n1", 0, prompt=(8, 8))  # the client's own session of that name (evicts "x")
    assert table.get("t", "s.h1.n1").parent_id == "" and table.get("t", "s") is not None
    joined = table.join("t", "s", "", end_children=True)
    assert joined.ended_ids == ()
    assert table.get("t", "s.h1.n1") is not None  # before: ended (and its pins released everywhere)


def test_a_session_joined_from_a_branch_on_every_hop_does_not_grow_without_bound():
    table = SessionTable()
    hop(table, "s", 0)
    for k in range(1, 31):
        branch = f"s.h{k}.n1"
        table.fork_or_new("t", "s", [branch], "s", k)
        hop(table, "s", k)  # choice 0
        hop(table, branch, k, prompt=(1, 2, 3, k))  # choice 1, the one the client picks
        table.join("t", "s", branch, end_children=True)
    parent = table.get("t", "s")
    assert parent.last_hop == 30 and parent.child_ids == [] and len(table) == 1
    # Only the last absorbed branch's pins can still hold the context the next hop reads; the
    # older ones were superseded by the hops since.
    assert len(parent.absorbed_ids) <= 2, len(parent.absorbed_ids)


def test_ending_the_parent_leaves_its_branches_which_never_join_a_new_session_of_the_same_id():
    table = SessionTable()
    hop(table, "s", 0)
    table.fork_or_new("t", "s", ["s.h1.n1", "s.h1.n2"], "s", 1)
    assert table.end("t", "s") is not None  # DELETE the parent: its children stay (docs/sessions.md)
    assert table.get("t", "s.h1.n1").parent_id == "s"
    hop(table, "s", 0, prompt=(6, 6))  # the client starts a new "s"
    with pytest.raises(SessionExistsError, match="s.h1.n1"):  # hop 1 with n: the old branches are in use
        table.fork_or_new("t", "s", ["s.h1.n1", "s.h1.n2"], "s", 1)
    assert table.get("t", "s").child_ids == []
    with pytest.raises(InvalidScheduleRequest) as exc:  # nor can the old branch be joined into it
        table.join("t", "s", "s.h1.n1", end_children=False)
    assert exc.value.field == "from_session_id"
    assert table.end("t", "s.h1.n1") is not None and table.end("t", "s.h1.n2") is not None
    forked = table.fork_or_new("t", "s", ["s.h1.n1", "s.h1.n2"], "s", 1)
    assert forked.parent is table.get("t", "s") and table.get("t", "s").child_ids == ["s.h1.n1", "s.h1.n2"]
    assert table.get("t", "s.h1.n1").context_token_ids.tolist() == [6, 6, 4]


def test_or_new_twice_with_the_same_ids_is_409_the_second_time_naming_the_first():
    """Not idempotent: a retried ForkSession (same ids) is refused for the ids its first
    attempt created. This is why a lost answer must be followed by ending them (above)."""
    table = SessionTable()
    table.fork_or_new("t", "s", ["s.h0.n1", "s.h0.n2"], "s", 0)
    with pytest.raises(SessionExistsError, match="s.h0.n1"):
        table.fork_or_new("t", "s", ["s.h0.n1", "s.h0.n2"], "s", 0)
    assert len(table) == 2


# -- malformed or_new requests straight at the scheduler servicer -------------------------------

class FakeAgent:
    """AgentSteps' own fork_session over a bare SessionTable."""

    fork_session = AgentSteps.fork_session

    def __init__(self, table: SessionTable) -> None:
        self.plane = SimpleNamespace(sessions=table)


def fork_request(session_id="s", child_ids=(), num_children=0, program_id="", next_hop=0, or_new=True):
    fork = router_pb2.ForkSessionRequest(session_id=session_id, child_session_ids=list(child_ids),
                                         num_children=num_children)
    return scheduler_pb2.SchedulerForkSessionRequest(tenant="t", fork=fork, or_new=or_new, program_id=program_id,
                                                     next_hop=next_hop)


@pytest.mark.parametrize("child_ids, num_children, field", [
    ((), 0, "num_children"),
    (("s",), 0, "child_session_ids[0]"),
    (("s.a", "s.a"), 0, "child_session_ids[1]"),
    (("",), 0, "child_session_ids[0]"),
    (("s.a", ""), 0, "child_session_ids[1]"),
    (tuple(f"s.{i}" for i in range(17)), 0, "num_children"),
    ((), 17, "num_children"),
    ((), 2**31, "num_children"),
])
def test_a_malformed_or_new_fork_at_the_servicer_names_the_field_and_creates_nothing(child_ids, num_children,
                                                                                      field):
    table = SessionTable()
    servicer = SchedulerServicer(SimpleNamespace(agent=FakeAgent(table)))
    with pytest.raises(InvalidScheduleRequest) as exc:
        asyncio.run(servicer.ForkSession(fork_request(child_ids=child_ids, num_children=num_children,
                                                      program_id="p" * 4096, next_hop=2**32 - 1), None))
    assert exc.value.field == field
    assert len(table) == 0


def test_an_or_new_fork_at_the_servicer_at_the_edges_of_next_hop_and_program():
    table = SessionTable()
    servicer = SchedulerServicer(SimpleNamespace(agent=FakeAgent(table)))
    resp = asyncio.run(servicer.ForkSession(fork_request(child_ids=["s.a"], next_hop=2**32 - 1), None))
    assert resp.new_sessions and list(resp.fork.child_session_ids) == ["s.a"] and resp.fork.num_context_tokens == 0
    child = table.get("t", "s.a")
    assert (child.program_id, child.last_hop, child.parent_id) == ("s", 2**32 - 2, "")  # no program: the session's
    with pytest.raises(ValueError):  # a negative next hop cannot even be sent (uint32)
        fork_request(next_hop=-1)
    resp = asyncio.run(servicer.ForkSession(fork_request(num_children=2, program_id="p"), None))  # default ids
    assert list(resp.fork.child_session_ids) == ["s.f0", "s.f1"] and table.get("t", "s.f1").program_id == "p"
    with pytest.raises(InvalidScheduleRequest) as exc:
        asyncio.run(servicer.ForkSession(fork_request(session_id="", child_ids=["a"]), None))
    assert exc.value.field == "session_id"
    with pytest.raises(SessionExistsError):  # the same request again: its ids are in use
        asyncio.run(servicer.ForkSession(fork_request(child_ids=["s.a"], next_hop=2**32 - 1), None))
    assert len(table) == 3


# -- choice 0 fails after its branches finished ---------------------------------------------------

class LateFailingExecutor(HostileExecutor):
    """While ``fail_late``: choice 0 (a request id without ".n<i>") sends one token, then
    fails once ``fail_now`` is set (its executor refuses mid-stream); the branches finish."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_late, self.fail_now = False, asyncio.Event()

    async def Generate(self, request, context):
        if self.fail_late and not re.search(r"\.n\d+$", request.request_id):
            yield executor_pb2.ExecuteResponse(request_id=request.request_id, token_ids_delta=[7], executor=self.name)
            await self.fail_now.wait()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "grammar.json_schema: cannot continue")
        async for chunk in super().Generate(request, context):
            yield chunk


def test_choice_0_failing_after_its_branches_finished_leaves_the_same_hop_askable_again(model_dir, monkeypatch):
    monkeypatch.setattr(choices_module, "HostileExecutor", LateFailingExecutor)

    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))
            mesh.executor.fail_late = True
            resp = await mesh.http.post("/v1/completions", json=completion(1, "s", n=3, stream=True), headers=A)
            assert resp.status == 200
            finished, events = set(), []
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    events.append(event)
                    finished.update(c["index"] for c in event.get("choices", []) if c.get("finish_reason"))
                    if {1, 2} <= finished:
                        mesh.executor.fail_now.set()  # both branches finished: now choice 0 fails
            mesh.executor.fail_late = False
            failed = [e for e in events if "error" in e]
            moved = mesh.table.get(TENANT_A, "s").last_hop
            await until(lambda: not mesh.left_behind(BRANCHES_H1), "the failed hop's branches to end", 5.0)
            return finished, failed, moved, await mesh.post(completion(1, "s", n=3))

    finished, failed, moved, again = asyncio.run(main())
    assert finished == {1, 2} and failed, (finished, failed)  # choice 0 failed the request
    assert moved == 0  # the session did not move: hop 1 is still the one to ask
    assert again[0] == 200 and sessions_of(again[1]) == ["s", *BRANCHES_H1], again
