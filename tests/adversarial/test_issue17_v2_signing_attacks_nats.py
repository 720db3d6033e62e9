"""The v2 signed documents (commit 7a7e4c0) on a real nats-server: routers publish on their
own subjects, a hostile client without the secret floods a router's *own* subject with
documents of the largest size the receivers take (a well-formed, current header, so each
costs the receiver an HMAC over 512 KiB), and an operator runs one router without the
secret. Routers and a scheduler's follower run in this process; the flooder is a separate
process (as an attacker with a router's NATS login would be). The server is started on a
free loopback port and stopped in ``finally`` (its context manager); every wait is on a
condition with a deadline."""
from __future__ import annotations

import asyncio
import functools
import json
import sys

import nats

from services.mesh.live_settings import BUS_KIND, ROUTER_BUS_KIND, SettingsFollower
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.nats_bus import EventBus
from services.mesh.nats_server import NatsServer
from services.mesh.settings_signing import DocumentSeal, split_signed
from services.router.auth import KeyStore
from services.router.live_settings import LiveOptions, RouterLiveSettings
from tests import waiting
from tests.live_settings_keys import knows

DEADLINE_S = 30.0
REPUBLISH_S = 0.2
SECRET = "issue17-v2-nats-secret"
KEYS = {"sk-ops-admin-0001": {"tenant": "ops", "role": "admin"}, "sk-acme-tenant-01": "acme"}
FLOOD_COUNT = 100  # x 512 KiB = 50 MiB: below nats-server's 64 MiB max_pending, so no server drop is expected

until = functools.partial(waiting.until, deadline_s=DEADLINE_S)  # this file's own bound


def router(tmp_path, name: str, url: str, secret: str = SECRET) -> RouterLiveSettings:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    return RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file),
                              LiveOptions(nats_url=url, republish_s=REPUBLISH_S), writer=name,
                              security=MeshSecurity(secret=secret))


# Mis-signed documents of 512 KiB exactly (the inbox's max_bytes), each with a current
# sent_at and a distinct signature, on the victim's own subjects, as fast as NATS takes them.
FLOODER = """
import asyncio, sys, time
import nats
async def main(url, count, source):
    nc = await nats.connect(url, name="flooder")
    for i in range(count):
        kind = ("settings", "routersettings")[i % 2]
        head = b"weft-signed/2 %s %.3f %064x\\n" % (source.encode(), time.time(), i + 1)
        body = b'{"version": 999999, "updated_at": 9e9, "writer": "evil", "origin": "admin_api", "pad": "'
        body += b"x" * (512 * 1024 - len(head) - len(body) - 2) + b'"}'
        assert len(head) + len(body) == 512 * 1024
        await nc.publish("weft.%s.%s" % (kind, source), head + body)
    await nc.flush(timeout=60)
    await nc.close()
asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
"""


def test_a_flood_of_max_size_forgeries_on_a_routers_own_subject_never_reaches_a_handler(tmp_path):
    """Every forged document is refused by the screen before it takes a slot: no handler
    (router or scheduler) is ever handed one, router 1's PATCH made during the flood reaches
    router 2 and the scheduler, and no connection is cut off or reconnects."""
    async def scenario(url: str) -> None:
        first, second = router(tmp_path, "r1", url), router(tmp_path, "r2", url)
        applied: list[dict] = []
        scheduler = SettingsFollower("scheduler", "scheduler", applied.append, security=MeshSecurity(secret=SECRET))
        verifier = DocumentSeal(SECRET, "verifier")
        handed: list[tuple[str, bytes]] = []

        def recording(kind: str, handler):
            async def wrapped(data: bytes) -> bool:
                handed.append((kind, data))
                return await handler(data)
            return wrapped

        scheduler.receive = recording(BUS_KIND, scheduler.receive)
        second._on_router_document = recording(ROUTER_BUS_KIND, second._on_router_document)
        listener = EventBus(url, "scheduler")
        connects: list[int] = []
        listener.on_connect(lambda: connects.append(1))
        flooder = None
        try:
            await listener.start()
            await scheduler.subscribe(listener)
            for live in (first, second):
                await live.start()
            await until(lambda: not first.listening and not second.listening, "both routers to claim")
            second_connects: list[int] = []
            second.bus.on_connect(lambda: second_connects.append(1))
            flooder = await asyncio.create_subprocess_exec(sys.executable, "-c", FLOODER, url, str(FLOOD_COUNT),
                                                           first.source)
            await until(lambda: scheduler.seal.num_refused >= 1 and second.seal.num_refused >= 1,
                        "the flood to reach both receivers")
            await first.patch_when_caught_up({"keys": {"sk-acme-tenant-01": None}, "scheduler": {"policy": "fcfs"}})
            assert await asyncio.wait_for(flooder.wait(), DEADLINE_S) == 0
            await until(lambda: second.document == first.document, "router 2 to adopt the PATCH")
            await until(lambda: applied and applied[-1] == {"policy": "fcfs"}, "the scheduler to apply it")
            assert not knows(second, "sk-acme-tenant-01")
            for kind, data in handed:
                parts = split_signed(data)
                assert parts is not None and verifier.problem(kind, data) is None, "a forgery reached a handler"
                assert json.loads(parts[3])["writer"] in ("r1", "r2")
            assert scheduler.seal.num_refused + second.seal.num_refused <= FLOOD_COUNT
            assert connects == [1] and second_connects == [], "a receiver was cut off and reconnected"
            assert listener.num_disconnects == 0 and second.bus.num_disconnects == 0
        finally:
            if flooder is not None and flooder.returncode is None:
                flooder.kill()
                await flooder.wait()
            for live in (first, second):
                await live.stop()
            await listener.close()

    with NatsServer(log_path=tmp_path / "nats.log") as server:
        asyncio.run(scenario(server.url))
    assert "Slow Consumer" not in (tmp_path / "nats.log").read_text()


def test_each_router_publishes_on_its_own_subjects_with_a_matching_signed_source(tmp_path):
    """What a plain NATS client hears on weft.settings.> and weft.routersettings.>: one
    subject per router and kind, ``weft.<kind>.router-<writer>``, each document's header
    naming exactly that subject's source and verifying under the mesh secret."""
    async def scenario(url: str) -> tuple[dict[str, set[str]], tuple[str, str]]:
        first, second = router(tmp_path, "east.1", url), router(tmp_path, "west_2", url)
        heard: dict[str, set[str]] = {}
        problems: list[str] = []
        verifier = DocumentSeal(SECRET, "verifier")
        nc = await nats.connect(url, name="observer")

        async def on_message(msg) -> None:
            kind = msg.subject.split(".")[1]
            problem = verifier.problem(kind, msg.data, msg.subject)
            if problem is not None:
                problems.append(f"{msg.subject}: {problem}")
            heard.setdefault(msg.subject, set()).add(split_signed(msg.data)[0])

        try:
            await nc.subscribe("weft.settings.>", cb=on_message)
            await nc.subscribe("weft.routersettings.>", cb=on_message)
            await nc.flush()
            for live in (first, second):
                await live.start()
            await until(lambda: len(heard) == 4, "both routers on both kinds")
            assert problems == []
            assert first.source != second.source
            assert first.source.startswith("router-east-1") and second.source.startswith("router-west_2")
            return heard, (first.source, second.source)
        finally:
            for live in (first, second):
                await live.stop()
            await nc.close()

    with NatsServer(log_path=tmp_path / "nats.log") as server:
        heard, sources = asyncio.run(scenario(server.url))
    assert heard == {f"weft.{kind}.{source}": {source} for kind in (BUS_KIND, ROUTER_BUS_KIND) for source in sources}


def test_a_router_started_without_the_secret_is_refused_by_the_screen_and_follows_the_mesh(tmp_path):
    """Operator error over NATS: the bare router's plain documents are dropped by the secure
    router's screen (``refused``, counted ``unsigned``) and never reach its handler; the bare
    router reads the secure router's signed documents (unverified) and adopts its PATCH."""
    async def scenario(url: str) -> None:
        secure, bare = router(tmp_path, "secure", url), router(tmp_path, "bare", url, secret="")
        handed: list[bytes] = []
        original = secure._on_router_document

        async def recording(data: bytes) -> bool:
            handed.append(data)
            return await original(data)

        secure._on_router_document = recording
        try:
            for live in (secure, bare):
                await live.start()
            await until(lambda: not secure.listening and not bare.listening, "both routers to claim")
            await until(lambda: secure.seal.num_refused >= 2, "the bare router's republishes refused")
            await secure.patch_when_caught_up({"scheduler": {"policy": "fcfs"}})
            await until(lambda: bare.document == secure.document, "the bare router to adopt the signed PATCH")
            await bare.patch_when_caught_up({"scheduler": {"policy": "priority"}})
            refused_before = secure.seal.num_refused
            await until(lambda: secure.seal.num_refused >= refused_before + 2, "the bare router's change refused")
            assert secure.document.sections["scheduler"]["policy"] == "fcfs"
            assert all(split_signed(d) is not None and split_signed(d)[0] == secure.source for d in handed)
            inbox = next(i for i in secure.bus._doc_subs if i.kind == ROUTER_BUS_KIND)
            assert inbox.num_dropped >= secure.seal.num_refused >= refused_before + 2
            assert set(secure.seal._log_refusal._last) == {"unsigned"}
        finally:
            for live in (secure, bare):
                await live.stop()

    with NatsServer(log_path=tmp_path / "nats.log") as server:
        asyncio.run(scenario(server.url))
