"""Issue 17, a hostile client and an unlucky operator against the ``fork_id`` that a session
hop's ``n > 1`` fork records on its branches (``<sid>.h<hop>.n<i>``): the router's ends of a
failed hop's branches name it, and the scheduler ends a session only if that fork created it
(docs/sessions.md, "n > 1 on a session hop"). Attacked: a client that continues on a branch
before the failing request's ends run, a retry racing the old request's ends, a scheduler
that forgets everything between a fork and its ends, another tenant's ids, the public end /
fork doors (a client must never reach fork_id), the pins a join releases, and the context
array a fork's children share with their parent."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tests.adversarial import test_issue17_session_hop_choices as choices_module
from tests.adversarial.test_issue17_session_hop_choices import (A, B, BRANCHES_H1, JSON_OUT, TENANT_A, TENANT_B,
                                                                HostileExecutor, completion, grpc_hop, mesh_doors,
                                                                sessions_of)
from tests.unit.router.test_session_lifecycle_doors import grpc_key
from tests.waiting import until
from weft.v1 import executor_pb2, router_pb2


@pytest.fixture
def model_dir(tiny_model_dir):
    return tiny_model_dir  # the suite's tiny checkpoint (tests/adversarial/conftest.py)


class ChoiceZeroFailsLate(HostileExecutor):
    """While ``fail_hop`` is (session id, hop index): that hop of that session (choice 0 of
    an ``n > 1`` request) sends one token, then fails once ``fail_now`` is set; every other
    hop runs as HostileExecutor's."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_hop: tuple[str, int] | None = None
        self.fail_now = asyncio.Event()

    async def Generate(self, request, context):
        if self.fail_hop is not None and (request.session.session_id.rpartition("/")[2],
                                          request.session.hop_index) == self.fail_hop:
            yield executor_pb2.ExecuteResponse(request_id=request.request_id, token_ids_delta=[7], executor=self.name)
            await self.fail_now.wait()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "grammar.json_schema: cannot continue")
        async for chunk in super().Generate(request, context):
            yield chunk


class Ends:
    """The scheduler client, recording every end that names a fork (the router's ends of a
    failed hop's branches) and holding them while ``hold`` is clear."""

    def __init__(self, client) -> None:
        self.client = client
        self.hold = asyncio.Event()  # the ends wait while it is clear
        self.hold.set()
        self.asked: list[tuple[str, str]] = []  # (session id, fork id), as they were asked
        self.done: list[tuple[str, bool]] = []  # (session id, ended_now), as they came back

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def end_session(self, tenant, session_id, *args, fork_id="", **kwargs):
        if not fork_id:
            return await self.client.end_session(tenant, session_id, *args, **kwargs)
        self.asked.append((session_id, fork_id))
        await self.hold.wait()
        ended = await self.client.end_session(tenant, session_id, *args, fork_id=fork_id, **kwargs)
        self.done.append((session_id, ended.ended_now))
        return ended


def recording(into: list):
    return lambda client: into.append(Ends(client)) or into[-1]


async def until_branches_finish(mesh, door: str):
    """Hop 1 of "s" with n = 3 at ``door``, read until choices 1 and 2 have finished; returns
    ({index: its session id}, a coroutine that reads the rest: did the call fail?)."""
    ids, finished = {}, set()
    if door == "http":
        resp = await mesh.http.post("/v1/completions", json=completion(1, "s", n=3, stream=True), headers=A)
        lines = resp.content.__aiter__()

        async def rest():
            return any([b'"error"' in line async for line in lines])
        while not {1, 2} <= finished:
            line = await lines.__anext__()
            for c in json.loads(line[6:]).get("choices", []) if line.startswith(b"data: {") else ():
                if c.get("finish_reason"):
                    finished.add(c["index"])
                    ids[c["index"]] = c["weft"]["session_id"]
        return ids, rest()
    call = mesh.grpc.Generate(grpc_hop(1, n=3), metadata=grpc_key("sk-a"))

    async def rest():
        return await call.code() != grpc.StatusCode.OK
    while not {1, 2} <= finished:
        chunk = await call.read()
        ids[chunk.index] = chunk.session_id or ids.get(chunk.index)
        if chunk.finish_reason:
            finished.add(chunk.index)
    return ids, rest()


# -- a branch the client continued on before the failing request's ends ran --------------------

@pytest.mark.parametrize("door", ["http", "grpc"])
def test_a_branch_the_client_continued_on_before_choice_0_failed_is_never_ended(model_dir, monkeypatch, door):
    monkeypatch.setattr(choices_module, "HostileExecutor", ChoiceZeroFailsLate)
    ends = []

    async def main():
        async with mesh_doors(model_dir, monkeypatch, recording(ends)) as mesh:
            await mesh.post(completion(0, "s"))
            mesh.executor.fail_hop = ("s", 1)
            ids, rest = await until_branches_finish(mesh, door)
            # The client picks branch 1 at once and runs its hop 2 (choice 0 still runs).
            continued = await mesh.post(completion(2, ids[1], prompt=[5], session_stateful=True))
            mesh.executor.fail_now.set()
            failed = await rest
            mesh.executor.fail_hop = None
            await until(lambda: len(ends[0].done) == 2, "the failed request's two ends to come back")
            mine = mesh.table.get(TENANT_A, ids[1])
            after = (mine.last_hop if mine else None, mesh.left_behind(["s.h1.n2"]))
            nxt = await mesh.post(completion(3, ids[1], prompt=[6], session_stateful=True))
            return ids, continued, failed, after, nxt

    ids, continued, failed, after, nxt = asyncio.run(main())
    assert (ids[1], ids[2]) == ("s.h1.n1", "s.h1.n2")
    assert continued[0] == 200, continued
    assert failed  # choice 0 failed the request
    assert after == (2, [])  # the untouched branch ended; the one the client moved on is its own
    assert nxt[0] == 200, nxt


# -- a retry racing the old request's ends ------------------------------------------------------

def forget_everything(table) -> None:
    """The scheduler restarted: every session, claim and end it knew is gone."""
    for d in (table._sessions, table._running, table._ended, table._programs):
        d.clear()


async def fail_with_held_ends(mesh, ends: Ends) -> asyncio.Future:
    """Hop 1 of "s" with n = 3 that fails (every choice refused) and whose ends are held;
    returns the request, which waits for its ends (a client that gave up on it retries
    meanwhile)."""
    await mesh.post(completion(0, "s"))
    ends.hold.clear()
    mesh.executor.refuse_suffix = ""
    failing = asyncio.ensure_future(mesh.post(completion(1, "s", n=3, **JSON_OUT)))
    await until(lambda: len(ends.asked) == 2, "the failed request to ask its two ends")
    mesh.executor.refuse_suffix = None
    return failing


def test_a_retry_refused_while_the_old_ends_run_says_it_is_transient(model_dir, monkeypatch):
    ends = []

    async def main():
        async with mesh_doors(model_dir, monkeypatch, recording(ends)) as mesh:
            failing = await fail_with_held_ends(mesh, ends[0])
            retried = await mesh.post(completion(1, "s", n=3))
            ends[0].hold.set()
            await failing
            return retried, await mesh.post(completion(1, "s", n=3))

    retried, later = asyncio.run(main())
    assert later[0] == 200, later  # it was transient
    err = retried[1]["error"]
    assert retried[0] == 409 and err["param"] == "n", retried
    assert "choose another child id" not in err["message"] and "continue on it" not in err["message"], err


@pytest.mark.parametrize("gone", [
    "client_ended_them", "scheduler_restarted",
    "client_continued_on_them",
])
def test_an_old_requests_held_ends_never_end_what_the_client_or_its_retry_made_since(model_dir, monkeypatch, gone):
    ends = []

    async def main():
        async with mesh_doors(model_dir, monkeypatch, recording(ends)) as mesh:
            failing = await fail_with_held_ends(mesh, ends[0])
            retried = await mesh.post(completion(1, "s", n=3))  # the old branches are still there
            if gone == "client_ended_them":  # as the 409 says
                for sid in BRANCHES_H1:
                    assert (await mesh.http.delete(f"/v1/weft/sessions/{sid}", headers=A)).status == 200
            elif gone == "scheduler_restarted":
                forget_everything(mesh.table)
            if gone == "client_continued_on_them":  # the other thing the 409 says
                made = [await mesh.post(completion(1, sid)) for sid in BRANCHES_H1]
            else:
                made = [await mesh.post(completion(1, "s", n=3))]
            ends[0].hold.set()
            refused = await failing
            assert len(ends[0].done) == 2
            survivors = [getattr(mesh.table.get(TENANT_A, sid), "last_hop", None) for sid in BRANCHES_H1]
            nexts = [await mesh.post(completion(2, sid, prompt=[5], session_stateful=True)) for sid in BRANCHES_H1]
            return refused, retried, made, ends[0].done, survivors, nexts

    refused, retried, made, done, survivors, nexts = asyncio.run(main())
    assert refused[0] == 400 and refused[1]["error"]["param"] == "response_format", refused
    assert retried[0] == 409 and retried[1]["error"]["code"] == "session_exists", retried  # wording: above
    assert [m[0] for m in made] == [200] * len(made), made
    assert len(made) == 2 or sessions_of(made[0][1]) == ["s", *BRANCHES_H1]
    assert sorted(done) == [(sid, False) for sid in BRANCHES_H1]  # the old fork ended nothing
    assert survivors == [1, 1]  # what the client or its retry made since is still there
    assert [n[0] for n in nexts] == [200, 200], nexts


def test_a_retry_sent_the_moment_a_grpc_client_cancels_is_served_or_refused_transiently(model_dir, monkeypatch):
    ends = []

    async def main():
        async with mesh_doors(model_dir, monkeypatch, recording(ends)) as mesh:
            await mesh.post(completion(0, "s"))
            mesh.executor.gate.clear()
            call = mesh.grpc.Generate(grpc_hop(1, n=3), metadata=grpc_key("sk-a"))
            seen = set()
            while len(seen) < 3:  # each choice's first token
                seen.add((await call.read()).index)
            call.cancel()
            retry = asyncio.ensure_future(mesh.post(completion(1, "s", n=3)))  # no wait at all
            await until(lambda: len(mesh.executor.cancelled) == 3, "the old request's three hops cancelled")
            old_fork = ends[0].asked[0][1] if ends[0].asked else None
            mesh.executor.gate.set()
            first = await retry
            await until(lambda: len(ends[0].done) >= 2, "the cancelled request's ends to come back")
            again = first
            if first[0] != 200:  # refused: the old request's branches (or claim) were still there
                await until(lambda: not mesh.left_behind(BRANCHES_H1)
                            and mesh.table.running_hop(TENANT_A, "s") is None, "the old branches to end")
                again = await mesh.post(completion(1, "s", n=3))
            nexts = [await mesh.post(completion(2, sid, prompt=[5], session_stateful=True)) for sid in BRANCHES_H1]
            return first, old_fork, ends[0].asked, again, nexts

    first, old_fork, asked, again, nexts = asyncio.run(main())
    assert old_fork is not None and {sid for sid, _ in asked[:2]} == set(BRANCHES_H1)
    if first[0] != 200:  # refused: a 409 that says what is in the way, never a 5xx or a wrong hop
        assert first[0] == 409 and first[1]["error"]["code"] in ("session_busy", "session_exists"), first
    assert again[0] == 200 and sessions_of(again[1]) == ["s", *BRANCHES_H1], again
    assert all(f != old_fork for _, f in asked[2:])  # only the old request's ends carry its fork
    assert [n[0] for n in nexts] == [200, 200], nexts  # the retry's branches outlived the old ends


# -- another tenant; the public doors -----------------------------------------------------------

def test_another_tenants_failed_hop_on_the_same_ids_and_its_fork_id_never_end_this_tenants_branches(
        model_dir, monkeypatch):
    ends = []

    async def main():
        async with mesh_doors(model_dir, monkeypatch, recording(ends)) as mesh:
            for headers in (A, B):
                await mesh.post(completion(0, "s"), headers)
            ok = await mesh.post(completion(1, "s", n=3))  # A's s.h1.n1, s.h1.n2
            a_fork = mesh.table.get(TENANT_A, "s.h1.n1").fork_id
            mesh.executor.refuse_suffix = ""
            b_refused = await mesh.post(completion(1, "s", n=3, **JSON_OUT), B)  # B's branches of the same names
            mesh.executor.refuse_suffix = None
            b_left = [sid for sid in BRANCHES_H1 if mesh.table.get(TENANT_B, sid) is not None]
            # Straight at the scheduler: B's tenant with A's real fork id ends nothing of A's.
            forged = await ends[0].client.end_session(TENANT_B, "s.h1.n1", fork_id=a_fork)
            a_left = [mesh.table.get(TENANT_A, sid) is not None for sid in BRANCHES_H1]
            nxt = await mesh.post(completion(2, "s.h1.n1", prompt=[5], session_stateful=True))
            return ok, a_fork, b_refused, b_left, forged.ended_now, a_left, nxt

    ok, a_fork, b_refused, b_left, forged, a_left, nxt = asyncio.run(main())
    assert ok[0] == 200 and a_fork
    assert b_refused[0] == 400 and b_left == []  # B's own branches ended (its request awaited its ends)
    assert forged is False and a_left == [True, True]
    assert nxt[0] == 200, nxt


def with_extra(message, extra: bytes):
    """``message`` with fields its type does not have (kept as unknown fields, sent on)."""
    return type(message).FromString(message.SerializeToString() + extra)


def string_field(number: int, value: str) -> bytes:
    data = value.encode()
    return bytes([number << 3 | 2, len(data)]) + data


def test_no_public_door_lets_a_client_name_a_fork_id(model_dir, monkeypatch):
    ends = []

    async def main():
        async with mesh_doors(model_dir, monkeypatch, recording(ends)) as mesh:
            await mesh.post(completion(0, "s"))
            http_fork = await mesh.post({"child_ids": ["s.h1.n1"], "fork_id": "x"}, A, "/v1/weft/sessions/s/fork")
            fork = with_extra(router_pb2.ForkSessionRequest(session_id="s", child_session_ids=["s.h1.n2"]),
                              string_field(6, "x") + string_field(4, "x"))
            await mesh.grpc.ForkSession(fork, metadata=grpc_key("sk-a"))
            forks = [mesh.table.get(TENANT_A, sid).fork_id for sid in BRANCHES_H1]
            refused = await mesh.post(completion(1, "s", n=3))  # the ids are the client's own now
            end = with_extra(router_pb2.EndSessionRequest(session_id="s.h1.n2"), string_field(3, "x"))
            ended = await mesh.grpc.EndSession(end, metadata=grpc_key("sk-a"))
            deleted = await mesh.http.delete("/v1/weft/sessions/s.h1.n1?fork_id=x", headers=A)
            return http_fork, forks, refused, ended.ended_now, deleted.status, ends[0].asked, mesh.left_behind(
                BRANCHES_H1)

    http_fork, forks, refused, ended, deleted, asked, behind = asyncio.run(main())
    assert "fork_id" not in {f.name for m in (router_pb2.ForkSessionRequest, router_pb2.EndSessionRequest)
                             for f in m.DESCRIPTOR.fields}
    assert http_fork[0] == 200, http_fork
    assert forks == ["", ""]  # a client's own fork records none: no router end can ever match it
    assert refused[0] == 409 and refused[1]["error"]["code"] == "session_exists"
    assert ended is True and deleted == 200 and behind == []  # a public end ends whatever its fork
    assert asked == []  # no public call reached the scheduler with a fork id


# -- the pins a join releases; the context array a fork shares ------------------------------------

def join(mesh, session_id: str, from_id: str):
    return mesh.post({"from": from_id}, A, f"/v1/weft/sessions/{session_id}/join")


@pytest.mark.parametrize("how", ["child_joined_from_a_grandchild", "child_forked_after_a_join_ran_no_hop"])
def test_a_join_never_releases_the_pins_that_hold_the_context_it_continues_from(model_dir, monkeypatch, how):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))
            await mesh.post(completion(1, "s", n=2))  # s.h1.n1: a child of s
            if how == "child_joined_from_a_grandchild":
                await mesh.post(completion(2, "s.h1.n1", n=2))  # s.h1.n1.h2.n1: a child of s.h1.n1
                holder = "s.h1.n1.h2.n1"  # its hop 2 pinned the context s.h1.n1, then s, continue from
                joins = [("s.h1.n1", holder), ("s", "s.h1.n1")]
            else:
                holder = "s.h1.n1"  # its hop 1 pinned the context s continues from after the first join
                joins = [("s", holder), ("s", "c")]
            for i, (sid, from_id) in enumerate(joins):
                if i == 1:
                    if how != "child_joined_from_a_grandchild":
                        assert (await mesh.post({"child_ids": ["c"]}, A, "/v1/weft/sessions/s/fork"))[0] == 200
                    mesh.executor.released.clear()
                joined = await join(mesh, sid, from_id)
                assert joined[0] == 200, joined
            return holder, mesh.table.get(TENANT_A, "s").last_hop, list(mesh.executor.released)

    holder, last_hop, released = asyncio.run(main())
    assert last_hop == (2 if how == "child_joined_from_a_grandchild" else 1)  # s continues from the holder's hop
    assert f"{TENANT_A}/{holder}" not in released, released


def test_the_context_array_a_fork_shares_is_never_changed_in_place(model_dir, monkeypatch):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))
            assert (await mesh.post({"child_ids": ["c1", "c2", "c3"]}, A, "/v1/weft/sessions/s/fork"))[0] == 200
            shared = mesh.table.get(TENANT_A, "s").context_token_ids
            before = shared.tolist()
            sharing = [mesh.table.get(TENANT_A, c).context_token_ids is shared for c in ("c1", "c2", "c3")]
            outcomes = [
                await mesh.post(completion(1, "c1", prompt=[5], session_stateful=True)),
                await mesh.post(completion(1, "c2", prompt=[*before, 6])),  # stateless, shares the prefix
                await join(mesh, "s", "c3"),  # c3 ran nothing: s continues from the shared array itself
                await mesh.post(completion(1, "s", n=3, prompt=[7], session_stateful=True)),
                await mesh.post(completion(2, "s.h1.n1", prompt=[8], session_stateful=True)),
                await join(mesh, "s", "s.h1.n1"),
                await mesh.post(completion(3, "s", n=2, prompt=[1], session_stateful=True)),
            ]
            await mesh.http.delete("/v1/weft/sessions/c2", headers=A)
            mesh.executor.refuse_suffix = ""
            outcomes.append(await mesh.post(completion(2, "c1", n=2, prompt=[9], session_stateful=True, **JSON_OUT)))
            return shared.tolist(), before, sharing, [o[0] for o in outcomes]

    after, before, sharing, statuses = asyncio.run(main())
    assert sharing == [True, True, True]  # one array, not a copy each
    assert statuses == [200] * 7 + [400], statuses
    assert after == before
