"""A router's bus name (commit 7a7e4c0, services/router/live_settings.py ``bus_source``):
``router-`` and its writer id with every character a subject token cannot hold replaced by
``-``, cut at 128 characters. Each router is meant to publish on subjects of its own, so the
inboxes keep one slot per router and a document's signed ``source`` names one router.

The production writer id (``default_writer``: host, pid, 6 random hex digits) stays short on
Linux (hostnames are at most 64 bytes), and these tests check that it makes a valid, distinct
name. The sanitising and the cut are not one-to-one, though: two writer ids that differ only
in characters replaced by ``-``, or only after the cut, share one source (latent: a writer id
is passed explicitly only by tests today, and the cut needs a host name over ~110 bytes,
which macOS allows and Linux does not). Those tests fail on 7a7e4c0."""
from __future__ import annotations

import asyncio
import functools
import json

import pytest

from services.mesh.document_inbox import DocumentInbox
from services.mesh.live_settings import BUS_KIND, ROUTER_BUS_KIND
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.nats_bus import EventBus
from services.mesh.settings_signing import DocumentSeal, split_signed
from services.mesh.subjects import NAME_RE
from services.router import live_settings as router_live
from services.router.auth import KeyStore
from services.router.live_settings import LiveOptions, RouterLiveSettings, bus_source, default_writer
from tests import waiting

SECRET = "issue17-v2-bus-source-secret"
KEYS = {"sk-ops-admin-0001": {"tenant": "ops", "role": "admin"}}
DEADLINE_S = 10.0

until = functools.partial(waiting.until, deadline_s=DEADLINE_S)  # this file's own bound


def router(tmp_path, writer: str) -> RouterLiveSettings:
    folder = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    live = RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file), LiveOptions(), writer=writer,
                              security=MeshSecurity(secret=SECRET))
    live.claim()
    return live


# -- what production runs: passing ------------------------------------------------------------
@pytest.mark.parametrize("hostname", [
    "web-7d9f8-abcde", "node1.example.internal", "H" * 64, "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s.t.u.v.w.x.y.z",
    "xn--bcher-kva.example", "host_with_underscores",
])
def test_the_default_writer_makes_a_valid_distinct_bus_name_on_any_linux_hostname(monkeypatch, hostname):
    monkeypatch.setattr(router_live.socket, "gethostname", lambda: hostname)
    names = {bus_source(default_writer()) for _ in range(20)}
    assert len(names) == 20  # the random tail survives sanitising and the cut
    for name in names:
        assert NAME_RE.match(name) and len(name) <= 128 and name.startswith("router-")
        EventBus("nats://127.0.0.1:1", name)  # the bus takes it as its source


@pytest.mark.parametrize("writer", ["east.1", "r\u00e9gion-1", "\u65e5\u672c", "a b\tc", "x" * 300, "-", "."])
def test_any_writer_id_seals_and_is_admitted_on_its_own_subject(tmp_path, writer):
    """Dots, unicode, whitespace, a 300-character id: the router's source is a bus name the
    seal accepts, and a receiver admits the document on ``weft.<kind>.<source>`` only."""
    live = router(tmp_path, writer)
    receiver = DocumentSeal(SECRET, "router")
    for kind in (BUS_KIND, ROUTER_BUS_KIND):
        data = live.sealed(kind)
        assert split_signed(data)[0] == live.source
        assert receiver.admits(kind, f"weft.{kind}.{live.source}", data)
        assert not receiver.admits(kind, f"weft.{kind}.router-other", data)


def test_an_empty_writer_id_is_replaced_by_the_default_one(tmp_path):
    first, second = router(tmp_path, ""), router(tmp_path, "")
    assert first.writer and first.source != second.source


# -- collisions: failing on 7a7e4c0 --------------------------------------------------------------
@pytest.mark.parametrize("first, second", [
    ("east.1", "east-1"),
    ("node1.example.com", "node1-example-com"),  # a dot and a dash are one character on the bus
    ("\u65e5\u672c", "\u4e2d\u56fd"),  # two all-unicode ids: both "router---"
    ("h" * 121 + "-1234-abcdef", "h" * 121 + "-5678-012345"),  # same long host, pid and random tail cut off
])
def test_distinct_writer_ids_get_distinct_bus_sources(first, second):
    """Found by attack on 7a7e4c0 (latent). Two routers shared a subject when their ids
    differed only in replaced characters or after 121 characters; each one's republish then
    superseded the other's waiting change in every inbox, and the signature (over the
    source) could not tell them apart. Fixed: ``bus_source`` appends ``-`` and 12 hex digits
    of sha256(writer) whenever sanitising or the cut changed the id (at most 128 characters)."""
    assert first != second
    assert bus_source(first) != bus_source(second), f"{first!r} and {second!r} both publish as {bus_source(first)!r}"


def test_the_default_writer_on_a_host_name_longer_than_the_cut_keeps_its_random_tail(monkeypatch):
    """Found by attack on 7a7e4c0 (latent; fixed by the digest): ``default_writer`` puts the
    pid and the random tail last, and ``bus_source`` cut at 128, so two routers on one host
    whose name is longer than ~110 bytes (gethostname returns up to 255 on macOS; 64 on
    Linux) got one bus source."""
    monkeypatch.setattr(router_live.socket, "gethostname", lambda: "build-agent." + "x" * 180 + ".corp.example")
    names = {bus_source(default_writer()) for _ in range(5)}
    assert len(names) == 5, f"5 routers on one host share {len(names)} bus source(s): {sorted(names)}"


def test_two_routers_with_colliding_sources_supersede_each_others_waiting_change(tmp_path):
    """The consequence of a collision (failed on 7a7e4c0): router "east.1"'s change waits in a
    receiver's slot, router "east-1" republishes its own (older) document on the same subject,
    and the change is superseded; with distinct sources it would have kept its slot."""
    changed, other = router(tmp_path, "east.1"), router(tmp_path, "east-1")
    changed.patch({"scheduler": {"policy": "fcfs"}})
    receiver = DocumentSeal(SECRET, "router")

    async def scenario() -> list[str]:
        gate = asyncio.Event()
        handled: list[str] = []

        async def handler(data: bytes) -> bool:
            await gate.wait()
            handled.append(json.loads(split_signed(data)[3])["writer"])
            return True

        inbox = DocumentInbox(ROUTER_BUS_KIND, handler, clock=lambda: 0.0,
                              screen=functools.partial(receiver.admits, ROUTER_BUS_KIND))
        try:
            busy = router(tmp_path, "west-9")
            assert inbox.offer(f"weft.{ROUTER_BUS_KIND}.{busy.source}", busy.sealed(ROUTER_BUS_KIND))
            await until(lambda: not inbox._pending, "the worker busy with another router's document")
            assert inbox.offer(f"weft.{ROUTER_BUS_KIND}.{changed.source}", changed.sealed(ROUTER_BUS_KIND))
            assert inbox.offer(f"weft.{ROUTER_BUS_KIND}.{other.source}", other.sealed(ROUTER_BUS_KIND))
            gate.set()
            await until(lambda: not inbox._pending and inbox.num_handled + inbox.num_dropped >= 3,
                        "the slots emptied")
            return handled
        finally:
            await inbox.close()

    handled = asyncio.run(scenario())
    assert "east.1" in handled, f"router east.1's change was superseded by router east-1 (handled: {handled})"
