"""Issue 17, the branch-id gaps of ``n > 1`` on a session hop that the attack in
test_issue17_session_hop_choices.py left open, now closed: where there is no context to
fork (hop 0 of a new session; a stateless hop the scheduler holds no context for, as after
its restart) the branches used to start as new sessions unchecked, so a session the tenant
already had under a branch's id was refused as that session's wrong hop (400 naming the
other id) after choice 0 had run, or past hop 0 was continued by the branch. The router now
creates the branches first, all or nothing (``Scheduler.ForkSession`` with ``or_new``): an id
in use is 409 ``session_exists`` before any choice runs, and a refused hop ends what it
created."""
from __future__ import annotations

import asyncio

import pytest

from tests.adversarial.test_issue17_session_hop_choices import (TENANT_A, TENANT_B, B, completion, mesh_doors,
                                                                sessions_of)


@pytest.fixture
def model_dir(tiny_model_dir):
    return tiny_model_dir  # the suite's tiny checkpoint (tests/adversarial/conftest.py)


def test_hop_0_with_a_branch_id_in_use_is_409_before_choice_0_runs(model_dir, monkeypatch):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            own = await mesh.post(completion(0, "s.h0.n1", prompt=[9, 9, 9, 9]))  # the client's own session
            taken = await mesh.post(completion(0, "s", n=3))
            state = mesh.table.get(TENANT_A, "s.h0.n1")
            return (own, taken, mesh.table.get(TENANT_A, "s"), mesh.left_behind(["s.h0.n2"]),
                    (state.last_hop, state.context_token_ids.tolist()[:4]), await mesh.post(completion(0, "s", n=2)))

    own, taken, s, behind, (last_hop, context), again = asyncio.run(main())
    assert own[0] == 200
    assert taken[0] == 409 and taken[1]["error"]["code"] == "session_exists", taken
    assert taken[1]["error"]["param"] == "n" and "'s.h0.n1'" in taken[1]["error"]["message"]
    assert s is None  # choice 0 never ran: before the fix "s" had run hop 0 and the 400 came after
    assert behind == []  # all or nothing: n2 was not created either
    assert (last_hop, context) == (0, [9, 9, 9, 9])  # the client's session untouched
    assert again[0] == 409  # n = 2 still names the same branch


def test_hop_0_branches_are_created_first_and_continue_as_sessions_of_their_own(model_dir, monkeypatch):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            first = await mesh.post(completion(0, "s", n=3))
            branches = [mesh.table.get(TENANT_A, f"s.h0.n{i}") for i in (1, 2)]
            recorded = [(b.last_hop, b.program_id, b.parent_id) for b in branches]
            nexts = [await mesh.post(completion(1, sid)) for sid in ("s", "s.h0.n1", "s.h0.n2")]
            return first, recorded, nexts

    first, branches, nexts = asyncio.run(main())
    assert first[0] == 200 and sessions_of(first[1]) == ["s", "s.h0.n1", "s.h0.n2"]
    assert branches == [(0, "s", ""), (0, "s", "")]  # one program, not children of "s"
    assert [n[0] for n in nexts] == [200, 200, 200]


def test_a_refused_hop_0_ends_the_branches_it_created(model_dir, monkeypatch):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))  # "s" is past hop 0: hop 0 again is a wrong hop
            refused = await mesh.post(completion(0, "s", n=3))
            return refused, mesh.left_behind(["s.h0.n1", "s.h0.n2"]), await mesh.post(completion(1, "s", n=2))

    refused, behind, next_hop = asyncio.run(main())
    assert refused[0] == 400 and refused[1]["error"]["param"] == "session.hop_index", refused
    assert behind == []
    assert next_hop[0] == 200 and sessions_of(next_hop[1]) == ["s", "s.h1.n1"]


def test_a_stateless_hop_with_no_context_never_continues_a_session_named_like_its_branch(model_dir, monkeypatch):
    """A scheduler that lost its sessions (restart) holds no context for "r": hop 2 of it
    forks nothing. Before the fix its branch "r.h2.n1" ran as hop 2 of the client's own
    session of that name, which expected hop 2, and overwrote its context."""
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            for hop in (0, 1):
                await mesh.post(completion(hop, "r.h2.n1", prompt=[7, 7, 7, 7]))
            before = mesh.table.get(TENANT_A, "r.h2.n1").context_token_ids.tolist()
            taken = await mesh.post(completion(2, "r", n=2))
            after = mesh.table.get(TENANT_A, "r.h2.n1")
            fresh = await mesh.post(completion(2, "q", n=2))  # no context, no id in use: served
            q1 = mesh.table.get(TENANT_A, "q.h2.n1")
            return taken, before, (after.last_hop, after.context_token_ids.tolist()), fresh, q1.last_hop

    taken, before, (last_hop, context), fresh, q1_hop = asyncio.run(main())
    assert taken[0] == 409 and taken[1]["error"]["code"] == "session_exists", taken
    assert (last_hop, context) == (1, before)
    assert fresh[0] == 200 and sessions_of(fresh[1]) == ["q", "q.h2.n1"] and q1_hop == 2


def test_another_tenants_branch_ids_neither_block_nor_are_touched(model_dir, monkeypatch):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            theirs = await mesh.post(completion(0, "s.h0.n1", prompt=[5, 5, 5, 5]), headers=B)
            mine = await mesh.post(completion(0, "s", n=2))
            return theirs, mine, mesh.table.get(TENANT_B, "s.h0.n1").context_token_ids.tolist()[:4]

    theirs, mine, context = asyncio.run(main())
    assert theirs[0] == 200 and mine[0] == 200 and sessions_of(mine[1]) == ["s", "s.h0.n1"]
    assert context == [5, 5, 5, 5]
