"""Hostile envelopes on weft.settings and weft.routersettings under a mesh secret
(services/mesh/settings_signing.py), without processes: whatever a NATS client that may
publish as a router sends, a router keeps its keys and settings, a service keeps the
section it runs, and every refusal is counted and logged at most once per period, so a
flood costs neither memory nor log lines. Replay of a captured document into a router that
has nothing newer (a restart) was the one hole left: documents now carry a signed sent_at,
and a capture older than MAX_AGE_S is refused as stale. The format is v2 (a signed header
line over the raw bytes, settings_signing.py); the v1 JSON envelope is refused."""
from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from structlog.testing import capture_logs

from services.mesh import metrics
from services.mesh.live_settings import BUS_KIND, ROUTER_BUS_KIND, SettingsFollower
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.settings_signing import MAX_AGE_S, UnverifiedDocument, split_signed
from services.router.auth import KeyStore
from services.router.live_settings import LiveOptions, RouterLiveSettings
from tests.live_settings_keys import knows

CLOCK = itertools.count(3_000_000)  # unix seconds, one later at each reading
KEYS = {"sk-ops-admin-0001": {"tenant": "ops", "role": "admin"}, "sk-acme-tenant-01": "acme"}
SECRET = "issue17-a1-secret"


@pytest.fixture(autouse=True)
def _logs():
    with capture_logs() as logs:
        yield logs


def router(tmp_path, name: str, secret: str = SECRET, keys: dict | None = None, claim: bool = True):
    folder = tmp_path / name
    folder.mkdir()
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps(KEYS if keys is None else keys))
    live = RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file), LiveOptions(), writer=name,
                              clock=lambda: float(next(CLOCK)), security=MeshSecurity(secret=secret))
    if claim:
        live.claim()
    return live


def follower(applied: list, secret: str = SECRET) -> SettingsFollower:
    return SettingsFollower("scheduler", "scheduler", applied.append, security=MeshSecurity(secret=secret))


def refused(service: str, reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("weft_settings_refused_total",
                                             {"service": service, "reason": reason}) or 0.0


def signed(live: RouterLiveSettings, kind: str, doc=None) -> tuple[str, bytes, str, dict]:
    """(source, sent_at, signature, document) of what ``live`` publishes on ``kind``."""
    source, sent_at, signature, body = split_signed(live.sealed(kind, doc))
    return source, sent_at, signature, json.loads(body)


def framed(source: str, sent_at: bytes, signature: str, body: bytes) -> bytes:
    return b"weft-signed/2 %s %s %s\n%s" % (source.encode(), sent_at, signature.encode(), body)


def hostile_variants(live: RouterLiveSettings, kind: str) -> dict[str, bytes]:
    """Payloads a client without the secret can make from one genuine signed document."""
    genuine = live.sealed(kind)  # one sealing: a second one may carry a later sent_at, so another signature
    source, sent_at, sig, body = split_signed(genuine)
    doc = json.loads(body)
    newer = {**doc, "updated_at": doc["updated_at"] + 3600, "scheduler": {"policy": "fcfs"}}
    if kind == ROUTER_BUS_KIND:
        newer["keys"] = {"sk-evil-admin-0001": {"tenant": "evil", "role": "admin"}}
    dumps = lambda v: json.dumps(v).encode()  # noqa: E731
    return {
        "tampered": framed(source, sent_at, sig, dumps(newer)),
        "truncated": genuine[:-7],
        "extended": genuine + b" ",
        "not json": b"\xff\xfe not json at all",
        "empty": b"",
        "header only": genuine.split(b"\n", 1)[0] + b"\n",
        "no newline": genuine.replace(b"\n", b" ", 1),
        "crlf": genuine.replace(b"\n", b"\r\n", 1),
        "huge": framed(source, sent_at, sig, dumps({**newer, "pad": "x" * (2 << 20)})),
        "deeply nested": framed(source, sent_at, sig, b"[" * 100_000 + b"]" * 100_000),
        "nan": framed(source, sent_at, sig, b'{"version": NaN, "updated_at": Infinity}'),
        "upper-case hex": framed(source, sent_at, sig.upper(), dumps(newer)),
        "signature with whitespace": genuine.replace(sig.encode(), b" " + sig.encode(), 1),
        "short signature": framed(source, sent_at, sig[:-1], dumps(newer)),
        "sent_at moved": framed(source, b"%.3f" % (float(sent_at) + 1), sig, genuine.split(b"\n", 1)[1]),
        "sent_at exponent": framed(source, sent_at.replace(b".", b"e", 1), sig, genuine.split(b"\n", 1)[1]),
        "another source": framed("router-evil", sent_at, sig, genuine.split(b"\n", 1)[1]),
        "v1 envelope": dumps({"document": newer, "sent_at": float(sent_at), "signature": sig}),
        "bare document": dumps(newer),
        "bare list": dumps([newer, sig]),
        "non-ascii signature": framed(source, sent_at, "é" * 32, dumps(newer)),
    }


def test_no_hostile_router_document_changes_a_routers_keys_or_settings(tmp_path):
    ours = router(tmp_path, "router-ours")
    genuine = router(tmp_path, "router-peer")
    genuine.patch({"scheduler": {"policy": "priority"}})
    held = ours.document
    for name, data in hostile_variants(genuine, ROUTER_BUS_KIND).items():
        asyncio.run(ours._on_router_document(data))  # what the subscription runs: never raises
        assert ours.document == held, name
        assert not knows(ours, "sk-evil-admin-0001"), name
    assert knows(ours, "sk-acme-tenant-01")


def test_no_hostile_settings_document_changes_what_a_service_runs(tmp_path):
    genuine = router(tmp_path, "router-peer")
    genuine.patch({"scheduler": {"policy": "priority"}})
    applied: list[dict] = []
    service = follower(applied)
    asyncio.run(service.receive(genuine.sealed(BUS_KIND)))
    assert applied == [{"policy": "priority"}]
    for name, data in hostile_variants(genuine, BUS_KIND).items():
        asyncio.run(service.receive(data))
        assert applied == [{"policy": "priority"}], name
        assert service.stamp == genuine.document.stamp, name


def test_a_valid_router_envelope_is_refused_on_the_settings_subject_and_the_other_way(tmp_path):
    genuine = router(tmp_path, "router-peer")
    genuine.patch({"scheduler": {"policy": "fcfs"}})
    applied: list[dict] = []
    asyncio.run(follower(applied).receive(genuine.sealed(ROUTER_BUS_KIND)))  # keys and all, well signed
    assert applied == []
    ours = router(tmp_path, "router-ours")
    with pytest.raises(UnverifiedDocument, match="bad_signature"):
        ours.adopt(genuine.sealed(BUS_KIND))


def test_a_flood_of_non_json_under_a_secret_is_counted_and_logged_once_per_period(tmp_path, _logs):
    """Non-JSON on either subject is no signed document: refused as ``unsigned``, counted,
    and rate-limited like any other refusal. On the old code it skipped the seal: each one
    was a warning line of its own (a log flood any publisher could cause) and uncounted."""
    ours = router(tmp_path, "router-ours")
    service = follower([])
    before = refused("router", "unsigned"), refused("scheduler", "unsigned")

    async def flood() -> None:
        for i in range(500):
            await ours._on_router_document(b"{not json " + str(i).encode())
            await service.receive(b"\x00\x01 garbage " + str(i).encode())

    asyncio.run(flood())
    lines = [e for e in _logs if e["event"] in ("live_settings_peer_refused", "live_settings_malformed")]
    assert len(lines) <= 2  # one per receiver and reason within the 10 s period
    assert refused("router", "unsigned") == before[0] + 500
    assert refused("scheduler", "unsigned") == before[1] + 500
    assert ours.seal.num_refused == 500 and service.seal.num_refused == 500


def test_the_refusal_log_keeps_one_slot_per_reason_under_a_flood_of_distinct_forgeries(tmp_path):
    ours = router(tmp_path, "router-ours")
    genuine = router(tmp_path, "router-peer")
    source, sent_at, _, doc = signed(genuine, ROUTER_BUS_KIND)
    for i in range(2000):
        forged = {**doc, "version": i + 10}
        asyncio.run(ours._on_router_document(framed(source, sent_at, f"{i:064x}", json.dumps(forged).encode())))
        asyncio.run(ours._on_router_document(json.dumps(forged).encode()))
    assert set(ours.seal._log_refusal._last) == {"bad_signature", "unsigned"}


def test_a_router_without_the_secret_reads_the_mesh_but_the_mesh_refuses_its_changes(tmp_path, _logs):
    """Operator error: one router started without WEFT_MESH_SECRET. It follows the signed
    mesh (unverified, warned once), but its own PATCH, answered 200 there, reaches nobody:
    the routers and services with the secret refuse it as ``unsigned`` and count it."""
    secured = router(tmp_path, "router-secured")
    bare = router(tmp_path, "router-bare", secret="")
    secured.patch({"scheduler": {"policy": "priority"}})
    bare.adopt(secured.sealed(ROUTER_BUS_KIND))
    assert bare.document == secured.document
    bare.patch({"scheduler": {"policy": "fcfs"}})
    before = refused("router", "unsigned")
    with pytest.raises(UnverifiedDocument, match="unsigned"):
        secured.adopt(bare.sealed(ROUTER_BUS_KIND))
    assert secured.document.sections["scheduler"]["policy"] == "priority"
    assert refused("router", "unsigned") == before + 1
    assert any(e["event"] == "live_settings_unverified" for e in _logs)


def test_routers_on_two_secrets_during_a_rotation_keep_apart(tmp_path):
    """A rolling restart that rotates the secret: old and new routers refuse each other's
    documents (counted as ``bad_signature``); neither takes the other's keys."""
    old = router(tmp_path, "router-old", secret="secret-2025")
    new = router(tmp_path, "router-new", secret="secret-2026", keys={"sk-new-admin-0001": {"tenant": "ops",
                                                                                           "role": "admin"}})
    new.patch({"scheduler": {"policy": "fcfs"}})
    with pytest.raises(UnverifiedDocument, match="bad_signature"):
        old.adopt(new.sealed(ROUTER_BUS_KIND))
    assert knows(old, "sk-acme-tenant-01") and not knows(old, "sk-new-admin-0001")


def test_a_replayed_old_change_does_not_revive_a_revoked_key_in_a_restarted_router(tmp_path):
    """A key revoked by a PATCH, then every router restarts (a lone router, or a full
    rollout) with the keys file that no longer holds it. A client that captured the
    signed document from before the revocation replays it during the listen window: it
    is a change (origin admin_api) stamped after the files' 0, so the router adopts it,
    claims nothing and republishes it: the revoked key works again, mesh-wide."""
    before = router(tmp_path, "router-before")
    before.patch({"keys": {"sk-leaked-key-001": "mallory"}})
    captured = before.sealed(ROUTER_BUS_KIND)  # signed: the mesh made it
    before.patch({"keys": {"sk-leaked-key-001": None}})  # revoked

    restarted = router(tmp_path, "router-restarted", claim=False)  # its keys file lacks the leaked key
    sent_at = float(split_signed(captured)[1])
    restarted.seal.wall_clock = lambda: sent_at + MAX_AGE_S + 1  # replayed while it listens, a while later
    with pytest.raises(UnverifiedDocument, match="stale"):
        restarted.adopt(captured)
    restarted.claim()
    assert not knows(restarted, "sk-leaked-key-001")
    fresh = router(tmp_path, "router-fresh", claim=False)
    fresh.adopt(captured)  # within the window (a genuine republish), the same bytes are taken
    assert knows(fresh, "sk-leaked-key-001")


def test_replays_to_a_service_running_the_newest_document_change_nothing(tmp_path):
    genuine = router(tmp_path, "router-peer")
    genuine.patch({"scheduler": {"policy": "fcfs"}})
    older = genuine.sealed(BUS_KIND)
    genuine.patch({"scheduler": {"policy": "priority"}})
    same_version_older = genuine.sealed(BUS_KIND, genuine.document.stamped(
        genuine.document.version, genuine.document.updated_at - 1, "router-peer", "admin_api"))
    genuine.patch({"scheduler": {"policy": "weft"}})
    higher_version_older = genuine.sealed(BUS_KIND, genuine.document.stamped(
        genuine.document.version + 5, genuine.document.updated_at - 1, "router-zz", "admin_api"))
    applied: list[dict] = []
    service = follower(applied)
    for data in (genuine.sealed(BUS_KIND), older, same_version_older, higher_version_older, older):
        asyncio.run(service.receive(data))
    assert applied == [{"policy": "weft"}] and service.stamp == genuine.document.stamp


def test_sighup_while_refusing_a_flood_reloads_and_publishes_signed(tmp_path):
    ours, peer = router(tmp_path, "router-ours"), router(tmp_path, "router-peer")
    for i in range(50):
        asyncio.run(ours._on_router_document(b"junk %d" % i))
    (tmp_path / "router-ours" / "keys.json").write_text(json.dumps({**KEYS, "sk-after-sighup-01": "globex"}))
    ours.reload()
    peer.adopt(ours.sealed(ROUTER_BUS_KIND))
    assert knows(peer, "sk-after-sighup-01") and ours.seal.num_refused == 50 and peer.seal.num_refused == 0


def test_a_malformed_document_republished_by_a_peer_is_logged_once_per_period(tmp_path, _logs):
    """A signed document this code cannot read (a newer router's new setting during a rolling
    upgrade, republished every few seconds), or junk without a secret: one line per period
    per receiver, with the error; on the old code every republish logged a warning."""
    newer = router(tmp_path, "router-newer")
    source, sent_at, _, doc = signed(newer, ROUTER_BUS_KIND)
    doc["scheduler"] = {"a_setting_from_the_future": 1}
    body = json.dumps(doc).encode()
    env = framed(source, sent_at, newer.seal.signature(ROUTER_BUS_KIND, source, sent_at, body), body)
    bus_body = json.dumps({k: v for k, v in doc.items() if k != "keys"}).encode()
    bus_env = framed(source, sent_at, newer.seal.signature(BUS_KIND, source, sent_at, bus_body), bus_body)
    ours, service, bare = router(tmp_path, "router-ours"), follower([]), follower([], secret="")
    for _ in range(30):
        asyncio.run(ours._on_router_document(env))
        asyncio.run(service.receive(bus_env))
        asyncio.run(bare.receive(b"junk"))
    lines = [e for e in _logs if e["event"] in ("live_settings_peer_refused", "live_settings_malformed")]
    assert len(lines) == 3 and all("error" in e for e in lines)
