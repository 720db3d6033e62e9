"""Signed live settings on a real nats-server (services/mesh/settings_signing.py,
services/router/live_settings.py), attacked: a publisher without the secret floods both
subjects while a PATCH travels, and a router dies right after answering a PATCH that
raced another router's start. Routers and a scheduler's follower run in this process on
a server on a free loopback port; every wait is on a condition with a deadline."""
from __future__ import annotations

import asyncio
import functools
import json

from structlog.testing import capture_logs

from services.mesh.live_settings import BUS_KIND, ROUTER_BUS_KIND, SettingsFollower
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.nats_bus import EventBus
from services.mesh.nats_server import NatsServer
from services.mesh.settings_signing import split_signed
from services.router.auth import KeyStore
from services.router.live_settings import LiveOptions, RouterLiveSettings
from tests import waiting
from tests.live_settings_keys import knows

DEADLINE_S = 20.0
REPUBLISH_S = 0.2
SECRET = "issue17-a1-mesh-secret"
KEYS = {"sk-ops-admin-0001": {"tenant": "ops", "role": "admin"}, "sk-acme-tenant-01": "acme"}


def router(tmp_path, name: str, url: str, secret: str = SECRET) -> RouterLiveSettings:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    keys_file = folder / "keys.json"
    if not keys_file.exists():
        keys_file.write_text(json.dumps(KEYS))
    return RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file),
                              LiveOptions(nats_url=url, republish_s=REPUBLISH_S), writer=name,
                              security=MeshSecurity(secret=secret))


until = functools.partial(waiting.until, deadline_s=DEADLINE_S)  # this file's own bound


def garbage(i: int, genuine: bytes) -> bytes:
    """Junk, a forgery under the genuine header (router 1's, heard on the flooder's subject),
    the same on the flooder's own source, a bare document: small (big floods are
    tests/unit/mesh/test_document_flood.py)."""
    source, sent_at, signature, body = split_signed(genuine)
    doc = json.loads(body)
    forged = json.dumps({**doc, "updated_at": doc["updated_at"] + 9999,
                         "keys": {"sk-evil-admin-0001": {"tenant": "evil", "role": "admin"}}}).encode()
    own = b"weft-signed/2 router-x %s %s\n" % (sent_at, signature.encode())
    return [b"\xff not json %d" % i, genuine.split(b"\n", 1)[0] + b"\n" + forged, own + forged, forged][i % 4]


def test_a_flood_without_the_secret_changes_nothing_and_a_real_patch_still_arrives(tmp_path):
    async def scenario(url: str) -> None:
        first, second = router(tmp_path, "router-1", url), router(tmp_path, "router-2", url)
        applied: list[dict] = []
        scheduler = SettingsFollower("scheduler", "scheduler", applied.append, security=MeshSecurity(secret=SECRET))
        listener, hostile = EventBus(url, "scheduler"), EventBus(url, "router-x")
        try:
            for bus in (listener, hostile):
                await bus.start()
            await scheduler.subscribe(listener)
            for live in (first, second):
                await live.start()
            await until(lambda: not first.listening and not second.listening, "both routers to claim")
            genuine = first.sealed(ROUTER_BUS_KIND)
            assert await hostile.wait_connected(DEADLINE_S)

            async def flood() -> None:
                for i in range(400):
                    await hostile.publish_document(ROUTER_BUS_KIND, garbage(i, genuine))
                    await hostile.publish_document(BUS_KIND, garbage(i + 1, genuine))

            flooding = asyncio.create_task(flood())
            await first.patch_when_caught_up({"keys": {"sk-globex-000001": "globex"},
                                              "scheduler": {"policy": "fcfs"}})
            await flooding
            await until(lambda: second.document == first.document, "router 2 to adopt the real patch")
            await until(lambda: applied and applied[-1] == {"policy": "fcfs"}, "the scheduler to apply it")
            await until(lambda: second.bus.num_documents_settled(ROUTER_BUS_KIND) >= 400
                        and listener.num_documents_settled(BUS_KIND) >= 400,
                        "the flood to be refused or superseded (services/mesh/document_inbox.py)")
            assert second.seal.num_refused >= 1 and scheduler.seal.num_refused >= 1
            assert knows(second, "sk-globex-000001") and not knows(second, "sk-evil-admin-0001")
            assert not knows(first, "sk-evil-admin-0001")
            assert set(second.seal._log_refusal._last) <= {"unsigned", "bad_signature", "wrong_subject"}
        finally:
            for live in (first, second):
                await live.stop()
            for bus in (listener, hostile):
                await bus.close()

    with NatsServer(log_path=tmp_path / "nats.log") as server, capture_logs() as logs:
        asyncio.run(scenario(server.url))
    refusals = [e for e in logs if e["event"] in ("live_settings_peer_refused", "live_settings_malformed",
                                                   "document_handler_failed")]
    assert len(refusals) <= 3 * 3 * 2  # per receiver and reason, a period or two: not one per message


def test_a_patch_that_raced_a_start_survives_and_one_lost_with_its_router_waits_in_its_files(tmp_path):
    """Router 1 takes a PATCH just as router 2's listen window closes (the claim runs with the
    PATCH not yet heard): router 2's claim is stamped later, router 1 stamps its change again,
    and both converge on the PATCH. Then the worst case, as kill -9 right after the 200:
    router 1 answers a second PATCH and dies before publishing it. Router 2 never hears it.
    Router 1 restarted hears router 2's newer change while it listens and adopts it, so the
    lost PATCH, although written to router 1's keys file, is not served; it takes effect at
    the next SIGHUP of that router (docs/live_config.md, "A router dies right after a PATCH")."""
    async def scenario(url: str) -> None:
        first = router(tmp_path, "router-1", url)
        await first.start()
        await until(lambda: not first.listening, "router 1 to claim")
        second = router(tmp_path, "router-2", url)
        claim = second.claim

        def racing_claim():
            first.patch({"keys": {"sk-raced-patch-01": "globex"}})  # answered 200, publish in flight
            return claim()

        second.claim = racing_claim
        restarted = None
        try:
            await second.start()
            await until(lambda: second.document == first.document and knows(second, "sk-raced-patch-01"),
                        "the raced PATCH to win on both routers")
            assert first.document.origin == "admin_api"

            bus, first.bus = first.bus, None  # dies before its publish task runs: kill -9 after the 200
            first.patch({"keys": {"sk-lost-patch-001": "initech"}})
            first._republish.cancel()
            await bus.close()
            await asyncio.sleep(0)
            assert not knows(second, "sk-lost-patch-001")  # router 2 keeps the mesh's last document
            assert knows(second, "sk-raced-patch-01")

            restarted = router(tmp_path, "router-1", url)  # same keys file, which holds both PATCHes
            restarted.writer = "router-1b"
            await restarted.start()
            await until(lambda: not restarted.listening, "the restarted router to claim")
            assert restarted.document == second.document and not knows(restarted, "sk-lost-patch-001")
            restarted.reload()  # SIGHUP: its keys file holds the lost PATCH
            await until(lambda: knows(second, "sk-lost-patch-001") and second.document == restarted.document,
                        "router 2 to adopt the reloaded router's keys")
        finally:
            for live in (second, restarted):
                if live is not None:
                    await live.stop()

    with NatsServer(log_path=tmp_path / "nats.log") as server:
        asyncio.run(scenario(server.url))
