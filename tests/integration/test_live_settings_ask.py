"""A follower that connects asks the routers for the live-settings document
(``weft.settingswant``) instead of serving on its start-up values until the next periodic
republish; a router whose own NATS link comes back publishes at once; a flood of asks
costs a few publishes (services/mesh/live_settings.py ``SettingsFollower.subscribe``,
services/router/live_settings.py ``RouterLiveSettings.publish_soon``).

Real nats-server with the mesh's role users and permissions, on a free loopback port,
stopped in ``finally`` (its context manager). The router republishes every 600 s, so
nothing periodic can explain what a follower receives within a test. Every wait is on a
condition with a deadline."""
from __future__ import annotations

import asyncio
import time

import nats

from services.router.live_settings import ANSWER_GAP_S
from tests.live_settings_bus import follower, nats_mesh, started_router, until  # noqa: F401  (nats_mesh: a fixture)


def test_services_that_start_after_the_routers_last_publish_run_the_document_at_once(tmp_path, nats_mesh):
    """A scheduler subscribing before its bus connects and an executor subscribing after
    both ask on connect and apply the router's document; nothing else would bring it for
    600 s."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = await started_router(tmp_path, server.url)
        sched, sched_bus, sched_applied = follower("scheduler", passwords, server.url)
        execu, exec_bus, exec_applied = follower("executor", passwords, server.url)
        try:
            await sched.subscribe(sched_bus)  # before the bus starts: the ask goes out on connect
            await sched_bus.start()
            await exec_bus.start()
            await until(lambda: exec_bus.connected, "the executor's bus to connect")
            await execu.subscribe(exec_bus)  # after: the ask goes out at once
            await until(lambda: sched.version == live.document.version and execu.version == live.document.version,
                        "both followers to run the router's document")
            assert sched_applied == [{"policy": "fcfs"}]
            assert exec_applied == []  # the document has no executor section: nothing to apply
            assert 1 <= live.num_answers <= 2  # one per ask at most
            assert sched_bus.num_dropped == 0 and exec_bus.num_dropped == 0  # the asks were allowed
        finally:
            await sched_bus.close()
            await exec_bus.close()
            await live.stop()

    asyncio.run(scenario())


def test_a_change_made_while_nats_was_down_reaches_the_follower_when_both_reconnect(tmp_path, nats_mesh):
    """The router's PATCH during a NATS outage is sent to nobody; when the server is back,
    the router publishes on its reconnect and the scheduler asks on its own, so the change
    arrives in whichever order the two reconnect."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = await started_router(tmp_path, server.url)
        sched, bus, applied = follower("scheduler", passwords, server.url)
        try:
            await sched.subscribe(bus)
            await bus.start()
            await until(lambda: applied == [{"policy": "fcfs"}], "the first document")
            server.stop()
            await until(lambda: not bus.connected and not live.bus.connected, "both to see NATS gone")
            changed = live.patch({"scheduler": {"policy": "priority"}})
            server.start()
            await until(lambda: sched.version == changed.version, "the change to reach the scheduler")
            assert applied[-1] == {"policy": "priority"}
        finally:
            await bus.close()
            await live.stop()

    asyncio.run(scenario())


def test_a_flood_of_asks_costs_a_few_publishes_and_a_later_follower_is_still_answered(tmp_path, nats_mesh):
    """2,000 asks on 40 subjects, sent as fast as an executor's login can, make the router
    publish at most once per ``ANSWER_GAP_S`` (plus the one in progress); a follower that
    connects afterwards still gets the document."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = await started_router(tmp_path, server.url)
        flooder = await nats.connect(server.url, user="executor", password=passwords["executor"])
        sched, bus, applied = follower("scheduler", passwords, server.url)
        try:
            began = time.monotonic()
            for i in range(2000):
                await flooder.publish(f"weft.settingswant.flood-{i % 40}", b"x" * 1024)
            await flooder.flush()
            await until(lambda: live.num_answers >= 1, "the flood to be answered")
            await sched.subscribe(bus)
            await bus.start()
            await until(lambda: applied == [{"policy": "fcfs"}], "the later follower to get the document")
            # answers are ANSWER_GAP_S apart, whatever the asks: the first, then one per gap
            assert live.num_answers <= 1 + (time.monotonic() - began) / ANSWER_GAP_S
        finally:
            await flooder.close()
            await bus.close()
            await live.stop()

    asyncio.run(scenario())


def test_the_cachestore_may_not_ask(tmp_path, nats_mesh):
    """The cachestore follows no settings: its login is refused the ask subject."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        violations: list[str] = []

        async def on_error(exc) -> None:
            violations.append(str(exc))

        conn = await nats.connect(server.url, user="cachestore", password=passwords["cachestore"], error_cb=on_error)
        try:
            await conn.publish("weft.settingswant.cachestore", b"")
            await conn.flush()
            await until(lambda: violations, "the server's -ERR")
            assert any("permissions violation" in v.lower() for v in violations)
        finally:
            await conn.close()

    asyncio.run(scenario())


def test_a_change_made_just_before_stop_is_published_and_nothing_is_left_running(tmp_path, nats_mesh):
    """A PATCH's publish is a task of its own: ``stop()`` right after it lets it reach the
    followers, then returns with none of the router's tasks left behind."""
    server, passwords = nats_mesh

    async def scenario() -> None:
        live = await started_router(tmp_path, server.url)
        sched, bus, applied = follower("scheduler", passwords, server.url)
        try:
            await sched.subscribe(bus)
            await bus.start()
            await until(lambda: applied == [{"policy": "fcfs"}], "the first document")
            before = {t for t in asyncio.all_tasks() if not t.done()}
            changed = live.patch({"scheduler": {"policy": "priority"}})
            await live.stop()  # at once: the change's publish has not run yet
            left = {t for t in asyncio.all_tasks() if not t.done()} - before
            assert not {t.get_name() for t in left} & {"settings-publish", "settings-answer"}, left
            await until(lambda: sched.version == changed.version, "the change to reach the scheduler")
            assert applied[-1] == {"policy": "priority"}
        finally:
            await bus.close()
            await live.stop()  # twice: harmless

    asyncio.run(scenario())
