"""SessionTable's side of ``n > 1`` on a session hop: ``fork_or_new`` (fork when there is a
context, else new sessions at the hop, all or nothing either way) and a parent's child list
that keeps only live children however many hops fork it."""
from __future__ import annotations

import pytest

from services.scheduler.errors import InvalidScheduleRequest, SessionBusyError, SessionExistsError
from services.scheduler.state.sessions import SessionTable


def hop(table: SessionTable, sid: str, index: int, tenant: str = "t", prompt=(1, 2, 3)) -> None:
    table.begin_hop(tenant, sid, "", index, False, list(prompt))
    table.end_hop(tenant, sid, "", index, list(prompt), [4], "e", len(prompt), 0, 0.0)


def test_with_no_context_the_children_are_new_sessions_at_the_hop_of_the_program():
    table = SessionTable()
    forked = table.fork_or_new("t", "s", ["s.h3.n1", "s.h3.n2"], "prog", 3)
    assert forked.parent is None
    assert [(c.session_id, c.program_id, c.last_hop, c.parent_id, len(c.context_token_ids))
            for c in forked.children] == [("s.h3.n1", "prog", 2, "", 0), ("s.h3.n2", "prog", 2, "", 0)]
    ctx = table.begin_hop("t", "s.h3.n1", "", 3, False, [5, 6])  # the hop the branch was made for
    assert ctx.num_new_tokens == 2 and ctx.session is forked.children[0]
    with pytest.raises(InvalidScheduleRequest, match="expects hop 3"):
        table.begin_hop("t", "s.h3.n2", "", 0, False, [5, 6])
    assert table.get("t", "s") is None  # the session itself is not created


def test_an_id_in_use_refuses_all_of_them_and_creates_nothing():
    table = SessionTable()
    hop(table, "s.h0.n2", 0)
    with pytest.raises(SessionExistsError, match="s.h0.n2"):
        table.fork_or_new("t", "s", ["s.h0.n1", "s.h0.n2"], "s", 0)
    assert table.get("t", "s.h0.n1") is None and table.get("t", "s.h0.n2").last_hop == 0
    table.claim("t", "s.h0.n3", "r1")  # a running hop with no record yet is in use too
    with pytest.raises(SessionExistsError, match="s.h0.n3"):
        table.fork_or_new("t", "s", ["s.h0.n3"], "s", 0)
    assert len(table) == 1


def test_another_tenants_ids_are_not_in_use():
    table = SessionTable()
    hop(table, "s.h0.n1", 0, tenant="other")
    forked = table.fork_or_new("t", "s", ["s.h0.n1"], "s", 0)
    assert forked.children[0].tenant == "t" and table.get("other", "s.h0.n1").last_hop == 0


def test_with_a_context_it_is_a_fork_and_a_running_session_is_busy():
    table = SessionTable()
    hop(table, "s", 0)
    forked = table.fork_or_new("t", "s", ["s.h1.n1"], "ignored", 7)
    assert forked.parent is table.get("t", "s")
    child = forked.children[0]
    assert (child.last_hop, child.parent_id, child.context_token_ids.tolist()) == (0, "s", [1, 2, 3, 4])
    table.claim("t", "s", "r2")
    with pytest.raises(SessionBusyError):
        table.fork_or_new("t", "s", ["s.h1.n2"], "s", 1)
    table.release_claim("t", "s", "r2")
    table.claim("t", "fresh", "r3")  # hop 0 of a new session running: nothing to fork yet, and busy
    with pytest.raises(SessionBusyError):
        table.fork_or_new("t", "fresh", ["fresh.h0.n1"], "fresh", 0)


def test_bad_child_ids_name_the_field_without_a_context_as_with_one():
    table = SessionTable()
    with pytest.raises(InvalidScheduleRequest) as exc:
        table.fork_or_new("t", "s", ["a", "a"], "s", 0)
    assert exc.value.field == "child_session_ids[1]"
    with pytest.raises(InvalidScheduleRequest):
        table.fork_or_new("t", "s", [f"c{i}" for i in range(17)], "s", 0)
    assert len(table) == 0


def test_a_parent_lists_only_its_live_children_however_many_hops_fork_it():
    table = SessionTable()
    hop(table, "s", 0)
    for k in range(1, 40):
        ids = [f"s.h{k}.n1", f"s.h{k}.n2"]
        table.fork("t", "s", ids)
        table.end("t", ids[1])  # one branch ended, one left to its pins (as a client leaves them)
        hop(table, "s", k)
    parent = table.get("t", "s")
    assert parent.child_ids == [f"s.h{k}.n1" for k in range(1, 40)]  # the ended ones are gone
    for k in range(1, 39):
        table.end("t", f"s.h{k}.n1")
    table.fork("t", "s", ["s.h40.n1"])
    assert parent.child_ids == ["s.h39.n1", "s.h40.n1"]


def test_a_forks_children_share_the_parents_context_and_each_later_hop_replaces_only_its_own():
    table = SessionTable()
    hop(table, "s", 0, prompt=tuple(range(1, 4001)))
    parent = table.get("t", "s")
    forked = table.fork("t", "s", [f"s.f{k}" for k in range(16)], fork_id="F")
    assert all(c.context_token_ids is parent.context_token_ids for c in forked.children)  # one copy, not 16
    assert all(table.created_by("t", c.session_id, "F") for c in forked.children)
    assert not table.created_by("t", "s", "F") and not table.created_by("t", "s.f0", "")
    table.begin_hop("t", "s.f0", "", 1, True, [7])
    table.end_hop("t", "s.f0", "", 1, [*range(1, 4001), 4, 7], [8], "e", 1, 0, 0.0)
    hop(table, "s", 1, prompt=(9, 9))
    assert table.get("t", "s.f0").context_token_ids.tolist() == [*range(1, 4001), 4, 7, 8]
    assert table.get("t", "s.f1").context_token_ids.tolist() == [*range(1, 4001), 4]  # untouched by both
    assert table.get("t", "s").context_token_ids.tolist() == [9, 9, 4]
    joined = table.join("t", "s", "s.f0", end_children=True)
    assert joined.parent.context_token_ids.tolist() == [*range(1, 4001), 4, 7, 8]
    assert len(joined.ended) == 15 and joined.superseded == ()
