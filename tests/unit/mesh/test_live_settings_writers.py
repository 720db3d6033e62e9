"""Live settings with several routers and failing services (issue 17 leftovers), without
processes: a service retries a document whose apply failed when it is republished; the
newest stamp wins over a stale router's republish (ties to the writer id); a router adopts
another router's newer document, keys included, and a lone restarted router claims its
own; the admin API lists keys by an id that keeps keys sharing a prefix apart."""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from services.mesh.live_settings import ROUTER_BUS_KIND, BUS_KIND, LiveDocument, SettingsError, SettingsFollower, key_id
from services.router.admin_routes import AdminRoutes
from services.router.auth import KeyStore
from services.router.errors import AuthenticationError
from services.router.live_settings import LiveOptions, RouterLiveSettings

KEYS = {"sk-admin-000001": {"tenant": "ops", "role": "admin"}, "sk-acme-0001": "acme", "sk-acme-0002": "acme"}


@pytest.fixture(autouse=True)
def _logs():
    with capture_logs() as logs:
        yield logs


def bus_doc(version: int, updated_at: float, writer: str, policy: str | None = None) -> bytes:
    return LiveDocument.parse({"version": version, "updated_at": updated_at, "writer": writer,
                               **({"scheduler": {"policy": policy}} if policy else {})}).bus_payload()


CLOCK = itertools.count(1_000_000)  # unix seconds, one later at each reading: the order is the test's


def router(tmp_path, name: str, keys: dict | None = None) -> RouterLiveSettings:
    folder = tmp_path / name
    folder.mkdir()
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps(keys or KEYS))
    return RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file), LiveOptions(), writer=name,
                              clock=lambda: float(next(CLOCK)))


@pytest.mark.parametrize("error", [ValueError("exceeds the pool"), RuntimeError("engine busy")])
def test_a_document_whose_apply_failed_is_applied_when_republished(_logs, error):
    calls: list[dict] = []

    def apply(overrides):
        calls.append(overrides)
        if len(calls) == 1:
            raise error

    follower = SettingsFollower("scheduler", "scheduler", apply)
    doc = bus_doc(2, 10.0, "r", "fcfs")
    asyncio.run(follower.receive(doc))
    assert follower.version == 0 and follower.stamp is None  # not marked handled
    failure = [e for e in _logs if e["event"] in ("live_settings_refused", "live_settings_apply_failed")]
    assert failure and failure[0]["error"] == str(error) and failure[0]["log_level"] == "error"
    asyncio.run(follower.receive(doc))  # the router's periodic republish of the same document
    assert calls == [{"policy": "fcfs"}] * 2 and follower.version == 2
    asyncio.run(follower.receive(doc))
    assert len(calls) == 2  # handled now: a republish is nothing to do


def test_a_refusal_repeated_on_every_republish_is_logged_once_as_an_error(_logs):
    def apply(overrides):
        raise ValueError("reserved blocks exceed the pool")

    follower = SettingsFollower("executor", "scheduler", apply)
    for _ in range(3):
        asyncio.run(follower.receive(bus_doc(2, 10.0, "r", "fcfs")))
    assert [e["log_level"] for e in _logs if e["event"] == "live_settings_refused"] == ["error", "debug", "debug"]


def test_an_older_document_is_ignored_and_equal_times_go_to_the_higher_version_then_writer():
    applied: list[dict] = []
    follower = SettingsFollower("scheduler", "scheduler", applied.append)
    asyncio.run(follower.receive(bus_doc(5, 100.0, "router-b", "fcfs")))
    asyncio.run(follower.receive(bus_doc(9, 50.0, "router-a", "priority")))  # older change, higher version
    assert applied == [{"policy": "fcfs"}] and follower.version == 5
    asyncio.run(follower.receive(bus_doc(5, 100.0, "router-a", "priority")))  # same time and version: writer
    asyncio.run(follower.receive(bus_doc(6, 100.0, "router-a", "weft")))  # same time, higher version
    assert applied == [{"policy": "fcfs"}, {"policy": "weft"}] and follower.version == 6


def test_a_router_adopts_a_newer_document_from_another_router_keys_included(tmp_path):
    a, b = router(tmp_path, "router-a"), router(tmp_path, "router-b")
    a.patch({"keys": {"sk-globex-0001": "globex"}, "scheduler": {"policy": "fcfs"}})
    with pytest.raises(AuthenticationError):
        b.keys.authenticate("sk-globex-0001")
    b.adopt(a.document.router_payload())
    assert b.keys.authenticate("sk-globex-0001") == "globex"
    assert b.document == a.document  # republished unchanged: the same stamp, so services see nothing new
    assert b.document.bus_payload() == a.document.bus_payload()
    assert a.adopt(b.document.router_payload()) == a.document  # its own document back: nothing to do
    old = b.document
    b.patch({"scheduler": {"policy": "priority"}})
    assert b.document.stamp > old.stamp and b.document.writer == "router-b"
    assert b.adopt(old.router_payload()).sections["scheduler"]["policy"] == "priority"  # older: kept ours


def test_a_starting_router_adopts_a_change_and_a_lone_restarted_one_claims_its_files(tmp_path):
    a = router(tmp_path, "router-a")
    a.claim()
    a.patch({"scheduler": {"policy": "fcfs"}})
    b = router(tmp_path, "router-b")  # a replica scaled out later, listening
    b.adopt(a.document.router_payload())
    assert b.claim().writer == "router-a" and dict(b.document.sections["scheduler"]) == {"policy": "fcfs"}
    follower = SettingsFollower("scheduler", "scheduler", lambda o: None)
    asyncio.run(follower.receive(a.document.bus_payload()))
    restarted = router(tmp_path, "router-c")  # the only router, restarted with no settings file: version 1
    assert restarted.document.stamp < a.document.stamp
    asyncio.run(follower.receive(restarted.claim().bus_payload()))
    assert follower.version == 1 and follower.stamp == restarted.document.stamp


def test_a_rolling_restart_with_a_new_keys_file_brings_its_keys_to_the_old_routers(tmp_path):
    old = router(tmp_path, "router-old")
    old.claim()
    new = router(tmp_path, "router-new", keys={**KEYS, "sk-rotated-0001": "acme"})
    new.adopt(old.document.router_payload())  # heard while listening: the old router's files, not adopted
    assert new.keys.authenticate("sk-rotated-0001") == "acme"
    old.adopt(new.claim().router_payload())
    assert old.keys.authenticate("sk-rotated-0001") == "acme" and old.document == new.document


def test_a_router_running_with_keys_adopts_no_keyless_document(tmp_path):
    b = router(tmp_path, "router-b")
    open_doc = LiveDocument(3, {}, {}, 1e12, "router-open", "admin_api")
    with pytest.raises(SettingsError):
        b.adopt(open_doc.router_payload())
    assert b.keys.authenticate("sk-acme-0001") == "acme"


def test_the_router_sends_keys_only_on_the_routers_subject(tmp_path):
    sent: dict[str, bytes] = {}

    class Bus:
        async def publish_document(self, kind: str, data: bytes) -> bool:
            sent[kind] = data
            return True

    live = router(tmp_path, "router-a")
    live.bus = Bus()
    asyncio.run(live.publish())
    assert set(sent) == {BUS_KIND, ROUTER_BUS_KIND}
    assert b"sk-acme" not in sent[BUS_KIND] and b"sk-acme-0001" in sent[ROUTER_BUS_KIND]
    assert json.loads(sent[BUS_KIND])["writer"] == "router-a"


def test_get_lists_every_key_by_an_id_and_never_the_key(tmp_path):
    live = router(tmp_path, "router-a")

    async def scenario():
        app = web.Application()
        AdminRoutes(live).register(app)
        async with TestClient(TestServer(app)) as client:
            admin = {"Authorization": "Bearer sk-admin-000001"}
            body = await (await client.get("/v1/weft/admin/settings", headers=admin)).json()
            stamped = await client.patch("/v1/weft/admin/settings", headers=admin, json={"updated_at": 1e12})
            return body, stamped.status, (await stamped.json())["error"]["param"]

    body, status, param = asyncio.run(scenario())
    assert len(body["keys"]) == 3  # the two sk-acme-… keys were one entry "sk-a…"
    for key, entry in KEYS.items():
        shown = key_id(key)
        assert shown == f"{key[:4]}…{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        assert body["keys"][shown]["tenant"] == (entry if isinstance(entry, str) else entry["tenant"])
    assert not any(key in json.dumps(body) for key in KEYS)
    assert body["writer"] == "router-a" and body["origin"] == "files"
    assert (status, param) == (400, "updated_at")


def test_a_short_key_shows_none_of_its_characters():
    assert key_id("sk-a").startswith("…") and "sk-a" not in key_id("sk-a")


def test_a_claim_that_raced_a_change_does_not_revert_it(tmp_path):
    """A router's claim stamps its files now; when the running router's PATCH was still in
    flight as the claimer's listen window closed, the running router adopted those files and
    the PATCH (answered 200) was reverted everywhere. The change is stamped again instead."""
    running = router(tmp_path, "router-a")
    running.claim()
    starting = router(tmp_path, "router-b", keys={**KEYS, "sk-files-only-01": "acme"})  # listening
    running.patch({"keys": {"sk-globex-0001": "globex"}, "scheduler": {"policy": "fcfs"}})
    claimed = starting.claim()  # the PATCH's document had not reached it yet
    assert claimed.stamp > running.document.stamp and claimed.origin == "files"
    running.adopt(claimed.router_payload())
    assert dict(running.document.sections["scheduler"]) == {"policy": "fcfs"}
    assert running.document.stamp > claimed.stamp and running.document.origin == "admin_api"
    starting.adopt(running.document.router_payload())
    assert starting.document == running.document and starting.keys.authenticate("sk-globex-0001") == "globex"
