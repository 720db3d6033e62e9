"""A flood of live-settings documents (issue 17): the inbox keeps the newest per subject and
refuses oversized ones (services/mesh/document_inbox.py), and on a real nats-server a
flood of big documents neither gets the subscriber cut off as a slow consumer nor keeps
the real document from being applied. Every wait is on a condition with a deadline."""
from __future__ import annotations

import asyncio
import functools
import sys
import time

from nats.errors import SlowConsumerError
from structlog.testing import capture_logs

from services.mesh import metrics
from services.mesh.document_inbox import DocumentInbox
from services.mesh.live_settings import BUS_KIND, LiveDocument, SettingsFollower
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.nats_bus import Delivery, EventBus
from services.mesh.nats_server import NatsServer
from services.mesh.settings_signing import DocumentSeal
from tests import waiting
from weft.v1 import events_pb2

DEADLINE_S = 30.0
SECRET = "issue17-flood-secret"


until = functools.partial(waiting.until, deadline_s=DEADLINE_S)  # this file's own bound


def dropped(kind: str, reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("weft_documents_dropped_total", {"kind": kind, "reason": reason}) or 0.0


def test_the_newest_document_per_subject_wins_and_a_flood_on_one_subject_spares_the_others():
    async def scenario():
        handled: list[bytes] = []
        gate = asyncio.Event()

        async def handler(data: bytes) -> None:
            await gate.wait()  # the first document holds the worker while the rest arrive
            handled.append(data)

        inbox = DocumentInbox("flood-a", handler)
        superseded = dropped("flood-a", "superseded")
        try:
            assert inbox.offer("weft.flood-a.x", b"x0")
            await until(lambda: not inbox._pending, "the worker to take the first document")
            for i in range(1, 101):
                assert inbox.offer("weft.flood-a.x", b"x%d" % i)
                if i == 50:
                    assert inbox.offer("weft.flood-a.router-1", b"real")
            gate.set()
            await until(lambda: len(handled) == 3, "three documents handled")
            assert handled == [b"x0", b"x100", b"real"]  # subjects in arrival order, each its newest
            assert dropped("flood-a", "superseded") - superseded == 99
        finally:
            await inbox.close()

    asyncio.run(scenario())


def test_an_oversized_document_is_refused_unread_and_a_full_inbox_drops_new_subjects_counted():
    async def scenario():
        handled: list[bytes] = []
        gate = asyncio.Event()

        async def handler(data: bytes) -> None:
            await gate.wait()
            handled.append(data)

        inbox = DocumentInbox("flood-b", handler, max_bytes=1024, max_subjects=2)
        too_large, overflow = dropped("flood-b", "too_large"), dropped("flood-b", "overflow")
        try:
            with capture_logs() as logs:
                for _ in range(50):
                    assert not inbox.offer("weft.flood-b.big", b"{" * 1025)
            assert dropped("flood-b", "too_large") - too_large == 50
            assert [e["event"] for e in logs] == ["documents_dropped"]  # rate-limited, not one per document
            assert inbox.offer("weft.flood-b.a", b"a")
            await until(lambda: not inbox._pending, "the worker to take the first document")
            assert inbox.offer("weft.flood-b.b", b"b") and inbox.offer("weft.flood-b.c", b"c")
            assert not inbox.offer("weft.flood-b.d", b"d")  # two subjects already wait
            assert dropped("flood-b", "overflow") - overflow == 1
            gate.set()
            await until(lambda: len(handled) == 3, "the waiting documents handled")
            assert handled == [b"a", b"b", b"c"]
        finally:
            await inbox.close()

    asyncio.run(scenario())


def test_a_failing_handler_does_not_stop_the_next_document():
    async def scenario():
        handled: list[bytes] = []

        async def handler(data: bytes) -> None:
            if data == b"bad":
                raise RuntimeError("boom")
            handled.append(data)

        inbox = DocumentInbox("flood-c", handler)
        try:
            inbox.offer("weft.flood-c.a", b"bad")
            await until(lambda: inbox.num_handled == 1, "the failing document")
            inbox.offer("weft.flood-c.a", b"good")
            await until(lambda: handled == [b"good"], "the next document")
        finally:
            await inbox.close()

    asyncio.run(scenario())


def test_a_slow_consumer_error_is_counted_for_the_documents_kind_and_not_fatal():
    async def scenario():
        bus = EventBus("nats://127.0.0.1:1", "scheduler")
        before = dropped("flood-d", "slow_consumer")

        async def handler(data: bytes) -> None:
            return None

        await bus.subscribe_documents("flood-d", handler)
        with capture_logs() as logs:
            for _ in range(20):
                await bus._on_error(SlowConsumerError("weft.flood-d.router-x", "", 7, None))
        assert dropped("flood-d", "slow_consumer") - before == 20
        assert [e["event"] for e in logs] == ["documents_dropped"]
        assert bus.num_disconnects == 0 and not bus.login_refused
        await bus.close()

    asyncio.run(scenario())


def test_a_document_too_large_for_the_receivers_is_not_sent_and_says_so_once():
    async def scenario():
        bus = EventBus("nats://127.0.0.1:1", "router-1", max_document_bytes=10)
        with capture_logs() as logs:
            for _ in range(5):
                assert await bus.publish_document("flood-e", b"x" * 11) is False
        warned = [e["event"] for e in logs if e["log_level"] == "warning"]
        assert warned == ["document_too_large"] and bus.num_dropped == 5
        await bus.close()

    asyncio.run(scenario())


# A separate process, as an attacker holding a router's NATS credentials would be: big
# documents with a well-formed header and a current sent_at, so each costs the receiver a
# signature check over its bytes, as fast as the connection takes them.
FLOODER = """
import asyncio, json, sys, time
import nats
async def main(url, count, size):
    nc = await nats.connect(url, name="flooder")
    doc = {"version": 1, "scheduler": {"k%d" % i: "x" * 20 for i in range(size // 33)}}
    payload = b"weft-signed/2 router-x %.3f %s\\n" % (time.time(), b"0" * 64) + json.dumps(doc).encode()
    for _ in range(count):
        await nc.publish("weft.settings.router-x", payload)
    await nc.flush(timeout=60)
    await nc.close()
asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def test_a_flood_of_big_documents_neither_cuts_the_subscriber_off_nor_loses_the_real_document(tmp_path):
    """200 documents of ~450 KB (90 MB, more than nats-server's 64 MiB max_pending per
    connection): each is refused for its signature before it takes a slot; before the inbox
    the subscriber parsed them back to back, read its socket no faster, and was cut off."""
    async def scenario(url: str) -> None:
        applied: list[dict] = []
        follower = SettingsFollower("scheduler", "scheduler", applied.append, security=MeshSecurity(secret=SECRET))
        listener, executor, router = EventBus(url, "scheduler"), EventBus(url, "ex-1"), EventBus(url, "router-1")
        deliveries: list[Delivery] = []
        connects: list[float] = []
        listener.on_connect(lambda: connects.append(time.monotonic()))  # the first connect and every reconnect
        beating = True

        async def beat() -> None:  # a heartbeat every 10 ms, as executors send them (paced, not a wait)
            while beating:
                await executor.publish("heartbeat", events_pb2.ExecutorHeartbeat(name="ex-1"))
                await asyncio.sleep(0.01)

        try:
            for bus in (listener, executor, router):
                await bus.start()
            await follower.subscribe(listener)
            await listener.subscribe("heartbeat", events_pb2.ExecutorHeartbeat, lambda e, d: deliveries.append(d))
            for bus in (listener, executor, router):
                assert await bus.wait_connected(DEADLINE_S)
            beats = asyncio.create_task(beat())
            await until(lambda: deliveries, "the first heartbeat")
            flooder = await asyncio.create_subprocess_exec(sys.executable, "-c", FLOODER, url, "200", "450000")
            assert await asyncio.wait_for(flooder.wait(), DEADLINE_S) == 0

            seal = DocumentSeal(SECRET, "router")  # a router republishes its newest document
            real = LiveDocument.parse({"scheduler": {"policy": "fcfs"}}).stamped(7, time.time(), "router-1", "admin_api")
            deadline = time.monotonic() + DEADLINE_S
            while not applied:
                assert time.monotonic() < deadline, "the real document was never applied"
                await router.publish_document(BUS_KIND, seal.seal(BUS_KIND, real.bus_document(), "router-1"))
                await asyncio.sleep(0.2)  # the republish period (pacing the publisher, not a wait)
            heard = len(deliveries)
            await until(lambda: len(deliveries) > heard + 5, "heartbeats after the flood")
            beating = False
            await beats
            assert applied[-1] == {"policy": "fcfs"} and follower.version == 7
            assert 1 <= follower.seal.num_refused <= 200  # the flood arrived, screened as it came
            assert len(connects) == 1, "the subscriber was cut off (as a slow consumer) and reconnected"
            assert Delivery.GAP not in deliveries and Delivery.RESTARTED not in deliveries
        finally:
            for bus in (listener, executor, router):
                await bus.close()

    with NatsServer(log_path=tmp_path / "nats.log") as server:
        asyncio.run(scenario(server.url))
    assert "Slow Consumer" not in (tmp_path / "nats.log").read_text()
