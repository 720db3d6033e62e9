"""Attacks on the live-settings ask (``weft.settingswant``, commit fb818db): a hostile
client holding an executor's or scheduler's NATS login, and an unlucky operator whose NATS
flaps or whose routers stop mid-answer.

Real nats-server with the mesh's role users and permissions on a free loopback port
(``NatsServer`` as a context manager, as tests/integration/test_live_settings_ask.py). The
routers republish every 600 s, so only an answer to an ask (or a change's own publish) can
deliver a document within a test. Every wait is on a condition with a deadline; the only
timing bound is the one derived from ``ANSWER_GAP_S``."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import sys
import time

import nats
import pytest

from services.mesh import nats_auth
from services.mesh.live_settings import BUS_KIND, ROUTER_BUS_KIND, WANT_KIND
from services.mesh.nats_server import NatsServer
from services.mesh.settings_signing import DocumentSeal, UnverifiedDocument
from services.router import live_settings as router_live_settings
from services.router.live_settings import ANSWER_GAP_S
from tests.live_settings_bus import (SECRET, follower, make_router, nats_mesh,  # noqa: F401  (nats_mesh: a fixture)
                                     started_router, until)

# A hostile executor in its own process: it floods asks as fast as loopback carries them,
# so the router's event loop does not pace the flood (as an in-process flooder would).
FLOOD_SCRIPT = r"""
import asyncio, os, sys
import nats

async def main(url, user, password, n_big, n_small, n_subjects, forever):
    nc = await nats.connect(url, user=user, password=password)
    big = b"\xff" * (1024 * 1024)  # NATS's max_payload
    junk = os.urandom(4096)
    sent = 0
    while True:
        for i in range(n_big):
            await nc.publish(f"weft.settingswant.big-{i % n_subjects}", big)
        for i in range(n_small):
            await nc.publish(f"weft.settingswant.s{i % n_subjects}", junk[: i % 4096])
        await nc.flush(timeout=60)
        sent += n_big + n_small
        if sent and not forever:
            break
        print("round", flush=True)
    print("done", sent, flush=True)
    if forever:
        await asyncio.Event().wait()
    await nc.close()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8])))
"""


async def flood_process(server, passwords, n_big: int, n_small: int, n_subjects: int, forever: bool = False):
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", FLOOD_SCRIPT, server.url, "executor", passwords["executor"],
        str(n_big), str(n_small), str(n_subjects), str(int(forever)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()})


async def read_line(proc) -> str:
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    if not line:
        err = await proc.stderr.read()
        raise AssertionError(f"flooder died: {err.decode(errors='replace')[-2000:]}")
    return line.decode()


async def stop_process(proc) -> None:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


def answer_tasks() -> list[asyncio.Task]:
    """Answer tasks that will still run (a task cancelled but not yet unwound does not count)."""
    return [t for t in asyncio.all_tasks()
            if t.get_name() == "settings-answer" and not t.done() and not t.cancelling()]


# -- floods ----------------------------------------------------------------------------------
def test_an_ask_flood_on_thousands_of_subjects_starves_neither_peer_documents_nor_followers(tmp_path, nats_mesh):
    """A hostile executor (own process) sends 60 asks of 1 MiB and 20,000 junk asks on
    5,000 distinct subjects (the ask inbox keeps 64 slots). Meanwhile a PATCH on router 1
    must reach router 2 (its ``weft.routersettings`` inbox) and a scheduler; neither router
    may be cut off as a slow consumer, and router 1's answers stay within the gap bound."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        r1 = await started_router(tmp_path, server.url, "r1")
        r2 = await started_router(tmp_path, server.url, "r2")
        sched, bus, applied = follower("scheduler", passwords, server.url)
        proc = None
        try:
            await sched.subscribe(bus)
            await bus.start()
            await until(lambda: sched.version >= 1 and applied, "the scheduler's first document")
            began = time.monotonic()
            heard1, heard2 = (r.bus.num_documents_settled(WANT_KIND) for r in (r1, r2))
            proc = await flood_process(server, passwords, 20, 5_000, 5_000, forever=True)
            await until(lambda: r1.bus.num_documents_settled(WANT_KIND) > heard1 + 200
                        and r2.bus.num_documents_settled(WANT_KIND) > heard2 + 200, "the flood to reach both routers")
            changed = r1.patch({"scheduler": {"policy": "priority"}})
            await until(lambda: r2.document.stamp == changed.stamp, "router 2 to adopt the PATCH during the flood")
            await until(lambda: sched.stamp == changed.stamp, "the scheduler to run the PATCH during the flood")
            assert proc.returncode is None, "the flood ended before the PATCH had landed: nothing tested"
            assert applied[-1] == {"policy": "priority"}
            assert r1.bus.num_disconnects == 0 and r2.bus.num_disconnects == 0, "a router was cut off"
            assert r1.bus.connected and r2.bus.connected
            elapsed = time.monotonic() - began
            for live in (r1, r2):
                assert live.num_answers <= 1 + elapsed / ANSWER_GAP_S, (live.writer, live.num_answers, elapsed)
            # nothing but the start-up publish, the PATCH (router 1) and the answers went out: 2 subjects each
            assert r1.bus.num_published + r1.bus.num_dropped <= 2 * (2 + r1.num_answers)
            assert r2.bus.num_published + r2.bus.num_dropped <= 2 * (1 + r2.num_answers)
            # the PATCH survives: a follower that connects after the flood gets it on its ask
            late, late_bus, late_applied = follower("executor", passwords, server.url, name="executor-late")
            late_bus_started = False
            try:
                await late.subscribe(late_bus)
                await late_bus.start()
                late_bus_started = True
                await until(lambda: late.stamp == changed.stamp, "a later follower to get the PATCH")
            finally:
                if late_bus_started:
                    await late_bus.close()
        finally:
            if proc is not None:
                await stop_process(proc)
            await bus.close()
            await r1.stop()
            await r2.stop()

    asyncio.run(scenario())


def test_stop_during_a_continuous_ask_flood_leaves_no_answer_behind_and_publishes_nothing_after(
        tmp_path, nats_mesh):
    """``stop()`` while asks keep arriving (and one answer waits its gap): it returns without
    raising, and afterwards no ``settings-answer`` task is alive and the router's bus
    publishes nothing more."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = await started_router(tmp_path, server.url)
        proc = await flood_process(server, passwords, 0, 2_000, 300, forever=True)
        try:
            assert (await read_line(proc)).startswith("round")
            await until(lambda: live.num_answers >= 2, "two answers: the next one now waits its gap")
            await until(lambda: answer_tasks(), "an answer waiting its gap")
            await live.stop()
            published = live.bus.num_published
            left = answer_tasks()
            # anything left behind would publish into the closed bus within one gap: wait for it
            if left:
                await asyncio.wait(left, timeout=5 * ANSWER_GAP_S)
            assert live.bus.num_published == published, "published after stop()"
            assert not left, f"stop() left answer tasks behind: {left}"
        finally:
            await stop_process(proc)

    asyncio.run(scenario())


def test_asks_still_waiting_in_the_inbox_when_stop_is_called_leave_no_answer_task_behind(tmp_path, nats_mesh):
    """A burst of asks (a rolling restart: many services reconnect as the router gets its
    SIGTERM) already read from the socket but not yet handled when ``stop()`` is called,
    with no answer scheduled. The inbox worker keeps running while ``stop()`` awaits the
    NATS close, so it handles them: an answer task must not be created after ``stop()``
    cancelled the others (it would outlive ``stop()`` and publish into the closed bus)."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = await started_router(tmp_path, server.url)
        inbox = next(i for i in live.bus._doc_subs if i.kind == WANT_KIND)
        assert live._answer is None
        for i in range(10):  # as ``on_message`` hands them over from the socket
            inbox.offer(f"weft.settingswant.executor-{i}", b"")
        dropped = live.bus.num_dropped
        answers = live.num_answers
        await live.stop()
        left = answer_tasks()
        alive_at_return = [repr(t) for t in left]
        if left:
            await asyncio.wait(left, timeout=5 * ANSWER_GAP_S)
        assert not left, f"stop() returned with an answer task still alive: {alive_at_return}"
        assert (live.num_answers, live.bus.num_dropped) == (answers, dropped), \
            "an answer ran after stop() and published into the closed bus (counted as dropped)"

    asyncio.run(scenario())


def test_a_flood_of_oversized_asks_does_not_silence_a_genuine_ask(tmp_path, nats_mesh):
    """A hostile executor floods asks of 1 MiB (NATS's max_payload; the inbox refuses them
    as too large, unanswered) without pause. A scheduler that connects during the flood
    must still be answered: its empty ask must not be lost behind the junk in nats-py's
    pending queue (64 messages / 8 MiB) with nothing else left to trigger an answer."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = await started_router(tmp_path, server.url)
        proc = await flood_process(server, passwords, 40, 0, 40, forever=True)
        sched, bus, applied = follower("scheduler", passwords, server.url)
        try:
            assert (await read_line(proc)).startswith("round")
            answers = live.num_answers
            await sched.subscribe(bus)
            await bus.start()
            await until(lambda: sched.stamp == live.document.stamp, "the scheduler's ask to be answered in the flood")
            assert proc.returncode is None, "the flood ended before the ask: nothing tested"
            assert live.num_answers > answers
            assert live.bus.num_disconnects == 0
        finally:
            await stop_process(proc)
            await bus.close()
            await live.stop()

    asyncio.run(scenario())


def test_stop_with_an_answer_pending_its_gap_cancels_it(tmp_path, nats_mesh, monkeypatch):
    """Two asks in a row: the second answer waits the gap (30 s here, so a slow machine
    cannot let it run before the test looks); ``stop()`` then cancels it without raising,
    and nothing reaches a listening scheduler after the stop."""
    monkeypatch.setattr(router_live_settings, "ANSWER_GAP_S", 30.0)
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = await started_router(tmp_path, server.url)
        heard: list[bytes] = []
        spy = await nats.connect(server.url, user="scheduler", password=passwords["scheduler"])
        asker = await nats.connect(server.url, user="executor", password=passwords["executor"])
        try:
            async def keep(msg) -> None:
                heard.append(msg.data)

            await spy.subscribe(f"weft.{BUS_KIND}.*", cb=keep)
            await spy.flush()
            await asker.publish("weft.settingswant.a", b"")
            await asker.flush()
            await until(lambda: live.num_answers == 1 and heard, "the first answer")
            await asker.publish("weft.settingswant.b", b"")
            await asker.flush()
            await until(lambda: live._answer is not None, "the second answer to wait its gap")
            pending = live._answer
            await live.stop()
            await asyncio.wait([pending], timeout=5 * ANSWER_GAP_S)
            assert pending.cancelled(), "the waiting answer was not cancelled"
            count = len(heard)
            await spy.flush()  # a round trip: anything the router had sent is delivered by now
            assert len(heard) == count == 1
            assert live.num_answers == 1
        finally:
            await spy.close()
            await asker.close()

    asyncio.run(scenario())


# -- start-up, flaps, several routers ------------------------------------------------------
def test_asks_heard_while_the_router_listens_are_not_answered_but_the_claim_reaches_the_asker(
        tmp_path, nats_mesh):
    """Real start-up (listen window 1.5 s): a scheduler that asks while the router still
    listens gets nothing then (the router publishes nothing before its claim), and the
    document right after the claim."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = make_router(tmp_path, server.url, republish_s=1.0)
        sched, bus, applied = follower("scheduler", passwords, server.url)
        try:
            await live.start()
            await sched.subscribe(bus)
            await bus.start()
            await until(lambda: live.bus.num_documents_settled(WANT_KIND) >= 1, "the router to hear the ask")
            assert live.listening, "listen window ended before the ask: the test proves nothing"
            assert live.num_answers == 0 and live.bus.num_published == 0, "published while listening"
            await until(lambda: not live.listening, "the claim")
            await until(lambda: sched.stamp == live.document.stamp, "the claimed document to reach the scheduler")
            assert applied == [{"policy": "fcfs"}]
        finally:
            await bus.close()
            await live.stop()

    asyncio.run(scenario())


def test_a_follower_whose_nats_flaps_ends_on_the_newest_document(tmp_path, nats_mesh):
    """NATS stopped and started three times; a PATCH while it is down and another while it
    is up between flaps: the scheduler ends on the last PATCH, with its own ask each time."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = await started_router(tmp_path, server.url)
        sched, bus, applied = follower("scheduler", passwords, server.url)
        try:
            await sched.subscribe(bus)
            await bus.start()
            await until(lambda: applied == [{"policy": "fcfs"}], "the first document")
            policies = ["priority", "fcfs", "priority", "fcfs", "priority", "fcfs"]
            for flap in range(3):
                server.stop()
                await until(lambda: not bus.connected and not live.bus.connected, "both to see NATS gone")
                down = live.patch({"scheduler": {"policy": policies[2 * flap]}})  # sent to nobody
                server.start()
                await until(lambda: sched.stamp == down.stamp, f"flap {flap}: the change made while down")
                up = live.patch({"scheduler": {"policy": policies[2 * flap + 1]}})
                await until(lambda: sched.stamp == up.stamp, f"flap {flap}: the change made while up")
            assert sched.version == live.document.version
            assert applied[-1] == {"policy": "fcfs"}
            assert bus.num_disconnects >= 3
        finally:
            await bus.close()
            await live.stop()

    asyncio.run(scenario())


def test_two_routers_answer_one_ask_and_the_follower_ends_on_the_newest_stamp(tmp_path, nats_mesh):
    """Router 1 holds a PATCH; router 2 started after it (its clock 1,000 s behind) holds its
    own older files. Both answer one follower's ask, in whichever order: the follower ends
    on router 1's change, and stays there after more asks."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        r1 = await started_router(tmp_path, server.url, "r1")
        changed = r1.patch({"scheduler": {"policy": "priority"}})
        await until(lambda: r1.bus.num_published >= 4, "the PATCH's own publish")  # start + PATCH, 2 subjects each
        r2 = await started_router(tmp_path, server.url, "r2", clock=lambda: time.time() - 1000.0)
        assert r2.document.stamp < changed.stamp
        sched, bus, applied = follower("scheduler", passwords, server.url)
        try:
            await sched.subscribe(bus)
            await bus.start()
            await until(lambda: r1.num_answers >= 1 and r2.num_answers >= 1, "both routers to answer")
            await until(lambda: sched.stamp == changed.stamp, "the newest document")
            await until(lambda: r2.document.stamp == changed.stamp, "router 2 to adopt router 1's answer")
            # more asks: both routers answer again, the follower stays on the newest
            await sched.ask(bus)
            await until(lambda: r1.num_answers >= 2 and r2.num_answers >= 2, "the second answers")
            assert sched.stamp == changed.stamp
            assert applied[-1] == {"policy": "priority"}
        finally:
            await bus.close()
            await r1.stop()
            await r2.stop()

    asyncio.run(scenario())


# -- the mesh secret -------------------------------------------------------------------------
def test_asks_never_make_a_router_publish_unsigned_and_forgeries_stay_refused(tmp_path, nats_mesh):
    """Under a mesh secret, every document a router publishes in answer to asks (junk
    bodies, many subjects) is signed with it, on both subjects. A forger holding the
    router's NATS login but not the secret publishes a newer document and then asks: the
    follower with the secret refuses the forgery and keeps the router's document."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = await started_router(tmp_path, server.url)
        settings_heard: list[bytes] = []
        router_heard: list[bytes] = []

        async def keep(into, msg) -> None:
            into.append(msg.data)

        spy = await nats.connect(server.url, user="scheduler", password=passwords["scheduler"])
        router_spy = await nats.connect(server.url, user="router", password=passwords["router"])
        asker = await nats.connect(server.url, user="executor", password=passwords["executor"])
        forger = await nats.connect(server.url, user="router", password=passwords["router"])
        sched, bus, applied = follower("scheduler", passwords, server.url)
        try:
            await spy.subscribe("weft.settings.>", cb=functools.partial(keep, settings_heard))
            await router_spy.subscribe("weft.routersettings.>", cb=functools.partial(keep, router_heard))
            await spy.flush()
            await router_spy.flush()
            await sched.subscribe(bus)
            await bus.start()
            await until(lambda: sched.stamp == live.document.stamp, "the genuine document")
            for i in range(300):
                await asker.publish(f"weft.settingswant.j{i}", os.urandom(i * 7))
            await asker.flush()
            await until(lambda: live.num_answers >= 2, "the asks to be answered")
            # a forgery: newer version and stamp, unsigned and signed with another secret
            bogus = {"version": 999, "updated_at": time.time() + 10, "writer": "zz-evil", "origin": "admin_api",
                     "scheduler": {"policy": "priority"}}
            await forger.publish("weft.settings.router-zz-evil", json.dumps(bogus).encode())
            await forger.publish("weft.settings.router-zz-evil",
                                 DocumentSeal("wrong-secret", "router").seal(BUS_KIND, bogus, "router-zz-evil"))
            await forger.flush()
            await asker.publish("weft.settingswant.after-forgery", b"")
            await asker.flush()
            await until(lambda: live.num_answers >= 3, "the ask after the forgery to be answered")
            await until(lambda: sched.seal.num_refused >= 2, "the follower to refuse both forgeries")
            await until(lambda: router_heard and len(settings_heard) >= 3, "the spies to hear the answers")
            assert sched.stamp == live.document.stamp and sched.version != 999
            assert applied == [{"policy": "fcfs"}]
            checker = DocumentSeal(SECRET, "test")
            genuine = [d for d in settings_heard if b"zz-evil" not in d]
            assert genuine, "no router document heard"
            for data in genuine:
                assert checker.problem(BUS_KIND, data) is None, data[:120]
            for data in router_heard:
                assert checker.problem(ROUTER_BUS_KIND, data) is None, data[:120]
                assert b"sk-ops-admin-0001" in checker.open(ROUTER_BUS_KIND, data)
            for data in genuine:
                assert b"sk-ops" not in data, "keys on weft.settings"
            with pytest.raises(UnverifiedDocument):
                DocumentSeal("wrong-secret", "test").open(BUS_KIND, genuine[0])
        finally:
            for conn in (spy, router_spy, asker, forger):
                await conn.close()
            await bus.close()
            await live.stop()

    asyncio.run(scenario())


# -- permissions -------------------------------------------------------------------------------
async def violations_of(server, user: str | None, password: str | None, action) -> list[str]:
    errors: list[str] = []

    async def on_error(exc) -> None:
        errors.append(str(exc))

    conn = await nats.connect(server.url, user=user, password=password, error_cb=on_error,
                              allow_reconnect=False)
    try:
        await action(conn)
        await conn.flush()
        await until(lambda: any("permissions violation" in e.lower() for e in errors), f"{user}: -ERR")
    finally:
        await conn.close()
    return errors


def test_only_followers_may_ask_and_asking_grants_nothing_else(tmp_path, nats_mesh):
    """The cachestore may not ask; an anonymous client cannot log in at all; the executor and
    scheduler that may ask still may not publish a document (``weft.settings``,
    ``weft.routersettings``) nor read other services' asks."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        async def pub(subject):
            async def act(conn):
                await conn.publish(subject, b"{}")
            return act

        async def sub(subject):
            async def act(conn):
                await conn.subscribe(subject)
            return act

        cases = [
            ("cachestore", await pub("weft.settingswant.cachestore")),
            ("executor", await pub("weft.settings.router-r1")),
            ("executor", await pub("weft.routersettings.router-r1")),
            ("scheduler", await pub("weft.settings.router-r1")),
            ("scheduler", await pub("weft.routersettings.router-r1")),
            ("executor", await sub("weft.settingswant.>")),
            ("scheduler", await sub("weft.settingswant.*")),
            ("router", await pub("weft.settingswant.router-r1")),
        ]
        for user, action in cases:
            await violations_of(server, user, passwords[user], action)
        with pytest.raises(Exception):
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        # and the asks the roles may send are not refused
        for user in ("executor", "scheduler"):
            errors: list[str] = []

            async def on_error(exc, errors=errors) -> None:
                errors.append(str(exc))

            conn = await nats.connect(server.url, user=user, password=passwords[user], error_cb=on_error)
            try:
                await conn.publish(f"weft.settingswant.{user}-1", b"")
                await conn.flush()
                await conn.flush()
                assert not errors, errors
            finally:
                await conn.close()

    asyncio.run(scenario())


def test_an_operator_who_kept_the_previous_nats_conf_loses_only_the_ask(tmp_path, monkeypatch):
    """A rolling upgrade whose NATS config still has the permissions from before the ask:
    the followers' asks and the router's subscription to them are refused by the server.
    That must cost only the ask: no connection is cut, the router still starts, and a
    PATCH's own publish still reaches the follower."""
    passwords = nats_auth.random_passwords()
    monkeypatch.setenv(nats_auth.USER_ENV, "router")
    monkeypatch.setenv(nats_auth.PASSWORD_ENV, passwords["router"])

    def without_asks(perm: nats_auth.Permissions) -> nats_auth.Permissions:
        return dataclasses.replace(perm, publish=tuple(p for p in perm.publish if "settingswant" not in p),
                                   subscribe=tuple(p for p in perm.subscribe if "settingswant" not in p))

    old = {role: without_asks(perm) for role, perm in nats_auth.role_permissions().items()}
    assert all("settingswant" not in " ".join(p.publish + p.subscribe) for p in old.values())

    async def scenario(server) -> None:
        live = await started_router(tmp_path, server.url)
        sched, bus, applied = follower("scheduler", passwords, server.url)
        try:
            await sched.subscribe(bus)
            await bus.start()
            await until(lambda: bus.connected, "the scheduler to connect")
            await sched.ask(bus)  # refused by the server, like the one on connect
            changed = live.patch({"scheduler": {"policy": "priority"}})
            await until(lambda: sched.stamp == changed.stamp, "the PATCH to reach the scheduler")
            assert live.num_answers == 0  # the asks never reached the router
            assert bus.connected and live.bus.connected
            assert bus.num_disconnects == 0 and live.bus.num_disconnects == 0
            assert applied == [{"policy": "priority"}]
        finally:
            await bus.close()
            await live.stop()

    with NatsServer(log_path=tmp_path / "nats.log", passwords=passwords, permissions=old) as server:
        asyncio.run(scenario(server))
