"""Issue 17 (session 3, attack): live settings across router replicas, as an unlucky
operator meets them (services/router/live_settings.py).

- A key added through the admin API on Kubernetes: the keys file is a Secret mount,
  read-only, and writing the change back raised, so the PATCH was an HTTP 500 and
  changed nothing, although the routers share the document precisely so that such a key
  works on every replica. The change runs now (shared with the other routers) and the
  failed write is logged: it lives until every router restarts, like a change made with
  no file configured.
- A router that starts while NATS is unreachable heard no other router during its listen
  window and claimed its own files as the newest document; once NATS was back, every
  running router adopted them and a PATCH made before (a key, a policy) was reverted
  mesh-wide. It listens once connected now.
- A SIGHUP for a new keys Secret, with no settings file (Kubernetes), reverted every
  setting changed through the admin API; what has no file keeps what runs now.
- A document stamped by a router whose clock ran a day ahead held every service for that
  day, even after every router was replaced (each PATCH answered 200, nothing applied).
- A PATCH on a router still listening reverted a change made on another replica: the
  admin API's change now waits for the router to catch up (503 + Retry-After past two
  listen windows).
"""
from __future__ import annotations

import asyncio
import errno
import json
import os

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from services.mesh import nats_bus
from services.mesh.live_settings import ROUTER_BUS_KIND, LiveDocument, SettingsFollower
from services.router.admin_routes import AdminRoutes
from services.router.auth import KeyStore
from services.router.live_settings import LiveOptions, RouterLiveSettings, VersionConflict

ADMIN = "sk-admin-000001"
KEYS = {ADMIN: {"tenant": "ops", "role": "admin"}, "sk-acme-0001": "acme"}
DEADLINE_S = 10.0


def _router(tmp_path, name: str, options: LiveOptions = LiveOptions(), clock=None) -> RouterLiveSettings:
    folder = tmp_path / name
    folder.mkdir()
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    kwargs = {"clock": clock} if clock else {}
    return RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file), options, writer=name, **kwargs)


def test_a_key_added_through_the_admin_api_works_when_the_keys_file_is_read_only(tmp_path, monkeypatch):
    live = _router(tmp_path, "router-a")

    def read_only(src, dst):  # a Secret volume: EROFS, whoever the process runs as
        raise OSError(errno.EROFS, "Read-only file system", str(dst))

    monkeypatch.setattr(os, "replace", read_only)

    async def scenario():
        app = web.Application()
        AdminRoutes(live).register(app)
        async with TestClient(TestServer(app)) as client:
            reply = await client.patch("/v1/weft/admin/settings", headers={"Authorization": f"Bearer {ADMIN}"},
                                       json={"keys": {"sk-globex-0001": "globex"}})
            return reply.status

    with capture_logs() as logs:
        status = asyncio.run(scenario())
    assert status == 200  # was 500, and the key was refused
    assert live.keys.authenticate("sk-globex-0001") == "globex"
    assert b"sk-globex-0001" in live.document.router_payload()  # shared with the other routers
    assert any(e["event"] == "live_settings_not_persisted" for e in logs)


class _UnreachableBus:
    """EventBus while NATS is down: connecting never succeeds until ``connect`` is called."""

    instances: list[_UnreachableBus] = []

    def __init__(self, url: str, source: str) -> None:
        self.published: dict[str, bytes] = {}
        self.handlers = []
        self.connected = asyncio.Event()
        self.asked = asyncio.Event()  # the router waits for the connection
        self.sent = asyncio.Event()
        _UnreachableBus.instances.append(self)

    async def start(self) -> None:
        pass

    async def require_login(self) -> None:
        pass  # returns when NATS is unreachable (an outage the bus rides out)

    async def subscribe_documents(self, kind, handler, screen=None, order=None) -> None:
        self.handlers.append((kind, handler))

    def on_connect(self, callback) -> None:
        pass  # the router publishes on a reconnect; this test drives the first connect only

    async def wait_connected(self, timeout_s: float) -> bool:
        self.asked.set()
        try:
            await asyncio.wait_for(self.connected.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def publish_document(self, kind: str, data: bytes) -> bool:
        self.published[kind] = data
        self.sent.set()
        return True

    async def close(self) -> None:
        pass


def test_a_router_started_during_a_nats_outage_does_not_revert_a_running_change(tmp_path, monkeypatch):
    running = _router(tmp_path, "router-a")
    running.claim()
    running.patch({"keys": {"sk-globex-0001": "globex"}, "scheduler": {"policy": "fcfs"}})
    monkeypatch.setattr(nats_bus, "EventBus", _UnreachableBus)
    starting = _router(tmp_path, "router-b", LiveOptions(nats_url="nats://down:4222", republish_s=0.01))

    async def scenario():
        await starting.start()
        bus = _UnreachableBus.instances[-1]
        waiting = asyncio.ensure_future(bus.asked.wait())
        sent = asyncio.ensure_future(bus.sent.wait())
        await asyncio.wait([waiting, sent], timeout=DEADLINE_S, return_when=asyncio.FIRST_COMPLETED)
        claimed_while_down = sent.done()
        if not claimed_while_down:
            assert waiting.done(), "the starting router neither waited for NATS nor published"
            # NATS is back: the subscription delivers the running router's republish, then connects.
            for kind, handler in bus.handlers:
                if kind == ROUTER_BUS_KIND:
                    await handler(running.document.router_payload())
            bus.connected.set()
            await asyncio.wait_for(bus.sent.wait(), DEADLINE_S)
        for task in (waiting, sent):
            task.cancel()
        await starting.stop()
        return claimed_while_down, bus.published[ROUTER_BUS_KIND]

    claimed_while_down, published = asyncio.run(scenario())
    running.adopt(published)  # what the running router hears from the new replica
    assert not claimed_while_down, "claimed its files while NATS was unreachable"
    assert running.keys.authenticate("sk-globex-0001") == "globex"
    assert dict(running.document.sections["scheduler"]) == {"policy": "fcfs"}
    assert starting.document == running.document


def test_a_failed_write_back_leaves_no_copy_of_the_keys_beside_the_file(tmp_path, monkeypatch):
    live = _router(tmp_path, "router-a")
    os.chmod(live.keys_file, 0o600)

    def refused(src, dst):  # e.g. the keys file replaced by a directory of the same name
        raise OSError(errno.EISDIR, "Is a directory", str(dst))

    monkeypatch.setattr(os, "replace", refused)
    with capture_logs():
        live.patch({"keys": {"sk-globex-0001": "globex"}})
    assert sorted(p.name for p in (tmp_path / "router-a").iterdir()) == ["keys.json"]  # was: + .keys.json.<pid>.tmp


def test_a_service_follows_new_routers_after_a_router_whose_clock_ran_a_day_ahead(tmp_path):
    now = [1_800_000_000.0]
    fast = _router(tmp_path, "router-fast", clock=lambda: now[0] + 86_400)  # a node whose clock is a day ahead
    fast.claim()
    fast.patch({"scheduler": {"policy": "fcfs"}})
    applied: list[dict] = []
    follower = SettingsFollower("scheduler", "scheduler", applied.append, clock=lambda: now[0])
    asyncio.run(follower.receive(fast.document.bus_payload()))
    now[0] += 2
    asyncio.run(follower.receive(fast.document.bus_payload()))  # its last republish
    now[0] += 600  # every router replaced since (a new image): nobody holds the fast one's document
    fresh = _router(tmp_path, "router-new", clock=lambda: now[0])
    fresh.claim()
    fresh.patch({"scheduler": {"policy": "priority"}})
    asyncio.run(follower.receive(fresh.document.bus_payload()))
    assert applied[-1] == {"policy": "priority"}


def test_a_sighup_for_new_keys_keeps_the_settings_patched_when_no_settings_file_is_configured(tmp_path):
    """Kubernetes sets no settings file; docs/live_config.md says to SIGHUP one router to
    pick up a new keys Secret. The reload took the sections from the absent file (none),
    so every setting changed through the admin API reverted on every router."""
    live = _router(tmp_path, "router-a")
    live.claim()
    live.patch({"scheduler": {"policy": "fcfs", "tenant_quotas": "acme=64"}})
    (tmp_path / "router-a" / "keys.json").write_text(json.dumps({**KEYS, "sk-rotated-0001": "acme"}))
    with capture_logs():
        live.reload()
    assert live.keys.authenticate("sk-rotated-0001") == "acme"
    assert dict(live.document.sections["scheduler"]) == {"policy": "fcfs", "tenant_quotas": "acme=64"}


def test_a_patch_on_a_router_still_listening_waits_and_keeps_a_change_made_on_another_replica(tmp_path):
    """A PATCH on a router that has not yet heard the others merged onto its own files, was
    stamped newest and reverted a change made on another replica (both callers got 200).
    The admin API's change now waits until the router has heard them (``claim``)."""
    running = _router(tmp_path, "router-a")
    running.claim()
    running.patch({"scheduler": {"policy": "fcfs"}})
    starting = _router(tmp_path, "router-b", LiveOptions(nats_url="nats://127.0.0.1:1"))  # has not heard router-a

    async def scenario():
        pending = asyncio.ensure_future(starting.patch_when_caught_up({"scheduler": {"tenant_quotas": "acme=64"}}))
        await asyncio.sleep(0)  # one loop turn: the PATCH is parked on the event, not applied
        assert not pending.done()
        starting.adopt(running.document.router_payload())  # the republish it was waiting for
        starting.claim()
        await asyncio.wait_for(pending, 10)

    asyncio.run(scenario())
    running.adopt(starting.document.router_payload())
    assert dict(running.document.sections["scheduler"]) == {"policy": "fcfs", "tenant_quotas": "acme=64"}


def test_a_patch_on_a_router_that_never_hears_the_others_is_refused_for_a_retry(tmp_path):
    from services.router.live_settings import CatchingUp

    starting = _router(tmp_path, "router-b", LiveOptions(nats_url="nats://127.0.0.1:1", republish_s=0.01))
    with pytest.raises(CatchingUp, match="retry"):
        asyncio.run(starting.patch_when_caught_up({"scheduler": {"policy": "fcfs"}}))
    assert "scheduler" not in starting.document.sections  # nothing changed


def test_a_fast_routers_older_document_does_not_replace_the_change_that_superseded_it(tmp_path):
    """The other side of the rule above: while the fast router still republishes its
    document, a change made after it (stamped after it by the router that adopted it)
    stays in force; so does the fast one against a correct router's stale republish."""
    now = [1_800_000_000.0]
    fast = _router(tmp_path, "router-fast", clock=lambda: now[0] + 86_400)
    other = _router(tmp_path, "router-other", clock=lambda: now[0])
    stale = LiveDocument(1, {}, {}, now[0] - 5, "router-stale", "files").bus_payload()
    fast.claim()
    fast.patch({"scheduler": {"policy": "fcfs"}})
    other.adopt(fast.document.router_payload())
    now[0] += 1
    other.patch({"scheduler": {"policy": "priority"}})
    applied: list[dict] = []
    follower = SettingsFollower("scheduler", "scheduler", applied.append, clock=lambda: now[0])
    for doc in (fast.document.bus_payload(), other.document.bus_payload(), stale):
        asyncio.run(follower.receive(doc))
    superseded = fast.document.bus_payload()
    now[0] += 2
    for doc in (superseded, stale, superseded):  # republished before the fast router adopts the change
        asyncio.run(follower.receive(doc))
    assert applied == [{"policy": "fcfs"}, {"policy": "priority"}] and follower.stamp == other.document.stamp
