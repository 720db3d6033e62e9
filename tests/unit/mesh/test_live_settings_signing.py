"""Live-settings documents signed with the mesh secret (services/mesh/settings_signing.py),
without processes: with a secret, a router adopts only documents signed with it (another
mesh's keys never arrive) and a service applies only signed settings; a tampered document,
one signed for the other subject, or an unsigned one is refused, logged and counted, and
the receiver keeps what it runs. Without a secret nothing changes: plain documents, byte
for byte as before, warned once."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json

import pytest
from structlog.testing import capture_logs

from services.mesh import metrics
from services.mesh.live_settings import BUS_KIND, ROUTER_BUS_KIND, LiveDocument, SettingsFollower
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.settings_signing import DocumentSeal, UnverifiedDocument, signed_bytes, split_signed
from services.router.auth import KeyStore
from services.router.live_settings import LiveOptions, RouterLiveSettings
from tests.live_settings_keys import knows

CLOCK = itertools.count(2_000_000)  # unix seconds, one later at each reading
OURS = {"sk-ours-admin-01": {"tenant": "ops", "role": "admin"}, "sk-ours-tenant-1": "acme"}
THEIRS = {"sk-theirs-admin1": {"tenant": "evil", "role": "admin"}, "sk-theirs-tenant": "mallory"}


@pytest.fixture(autouse=True)
def _logs():
    with capture_logs() as logs:
        yield logs


def router(tmp_path, name: str, secret: str, keys: dict) -> RouterLiveSettings:
    folder = tmp_path / name
    folder.mkdir()
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps(keys))
    live = RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file), LiveOptions(), writer=name,
                              clock=lambda: float(next(CLOCK)), security=MeshSecurity(secret=secret))
    live.claim()
    return live


def refused(reason: str, service: str = "router") -> float:
    return metrics.REGISTRY.get_sample_value("weft_settings_refused_total",
                                             {"service": service, "reason": reason}) or 0.0


def follower(secret: str, applied: list) -> SettingsFollower:
    return SettingsFollower("scheduler", "scheduler", applied.append, security=MeshSecurity(secret=secret))


def test_a_router_refuses_another_meshs_keys_and_keeps_its_own(tmp_path, _logs):
    ours = router(tmp_path, "router-ours", "secret-of-mesh-b", OURS)
    theirs = router(tmp_path, "router-theirs", "secret-of-mesh-a", THEIRS)
    theirs.patch({"scheduler": {"policy": "fcfs"}})  # newer than ours: adopted if it were trusted
    before = refused("bad_signature")
    with pytest.raises(UnverifiedDocument, match="bad_signature"):
        ours.adopt(theirs.sealed(ROUTER_BUS_KIND))
    assert ours.keys.authenticate("sk-ours-tenant-1") == "acme"
    assert not knows(ours, "sk-theirs-tenant")
    assert "scheduler" not in ours.document.sections and ours.document.writer == "router-ours"
    assert refused("bad_signature") == before + 1
    assert [e["reason"] for e in _logs if e["event"] == "live_settings_peer_refused"] == ["bad_signature"]


def test_routers_with_one_secret_converge_keys_included(tmp_path):
    a = router(tmp_path, "router-a", "one-secret", OURS)
    b = router(tmp_path, "router-b", "one-secret", OURS)
    a.patch({"keys": {"sk-globex-000001": "globex"}, "scheduler": {"policy": "priority"}})
    b.adopt(a.sealed(ROUTER_BUS_KIND))
    assert b.document == a.document
    assert b.keys.authenticate("sk-globex-000001") == "globex"
    # b republishes a's document, signed alike (each seal stamps its own source and sent_at)
    (b_source, b_sent, mine, b_body), (a_source, a_sent, theirs, a_body) = (
        split_signed(b.sealed(BUS_KIND)), split_signed(a.sealed(BUS_KIND)))
    assert b_body == a_body and (b_source, a_source) == ("router-router-b", "router-router-a")
    assert mine == b.seal.signature(BUS_KIND, b_source, b_sent, b_body)
    assert theirs == b.seal.signature(BUS_KIND, a_source, a_sent, a_body)


def test_an_unsigned_document_is_refused_when_a_secret_is_set(tmp_path, _logs):
    ours = router(tmp_path, "router-ours", "s3cret", OURS)
    theirs = router(tmp_path, "router-theirs", "", THEIRS)  # a mesh without a secret on the same NATS
    theirs.patch({"scheduler": {"policy": "fcfs"}})
    with pytest.raises(UnverifiedDocument, match="unsigned"):
        ours.adopt(theirs.sealed(ROUTER_BUS_KIND))
    applied: list[dict] = []
    asyncio.run(follower("s3cret", applied).receive(theirs.sealed(BUS_KIND)))
    assert applied == [] and not knows(ours, "sk-theirs-tenant")
    assert {e["reason"] for e in _logs if e["event"] == "live_settings_peer_refused"} == {"unsigned"}


def test_a_service_refuses_a_mis_signed_settings_document_and_keeps_the_one_it_runs(tmp_path, _logs):
    ours = router(tmp_path, "router-ours", "s3cret", OURS)
    ours.patch({"scheduler": {"policy": "priority"}})
    applied: list[dict] = []
    service = follower("s3cret", applied)
    asyncio.run(service.receive(ours.sealed(BUS_KIND)))
    assert applied == [{"policy": "priority"}] and service.version == ours.document.version

    forger = router(tmp_path, "router-forger", "guessed-secret", {})
    forger.patch({"version": forger.document.version, "scheduler": {"policy": "fcfs"}})
    before = refused("bad_signature", "scheduler")
    asyncio.run(service.receive(forger.sealed(BUS_KIND)))
    assert applied == [{"policy": "priority"}] and service.version == ours.document.version
    assert refused("bad_signature", "scheduler") == before + 1


def test_a_tampered_document_fails_its_signature(tmp_path):
    ours = router(tmp_path, "router-ours", "s3cret", OURS)
    data = ours.sealed(BUS_KIND)
    head, body = data.split(b"\n", 1)
    document = json.loads(body)
    document["scheduler"] = {"policy": "fcfs"}
    document["updated_at"] += 3600  # and newer, so it would win
    applied: list[dict] = []
    asyncio.run(follower("s3cret", applied).receive(head + b"\n" + json.dumps(document).encode()))
    assert applied == []


def test_a_document_signed_for_the_services_is_no_router_document(tmp_path):
    """The subject is signed: a settings document (no keys) is not valid as a routersettings one."""
    a = router(tmp_path, "router-a", "s3cret", OURS)
    b = router(tmp_path, "router-b", "s3cret", OURS)
    a.patch({"scheduler": {"policy": "fcfs"}})
    with pytest.raises(UnverifiedDocument, match="bad_signature"):
        b.adopt(a.sealed(BUS_KIND))
    assert "scheduler" not in b.document.sections


def test_the_signature_is_over_the_bytes_as_sent(tmp_path):
    """Checked before parsing (the inbox screens with it): the same document laid out
    otherwise is another byte string, refused; the bytes as sent are applied."""
    ours = router(tmp_path, "router-ours", "s3cret", OURS)
    ours.patch({"scheduler": {"policy": "fcfs", "tenant_quotas": "acme=64"}})
    head, body = ours.sealed(BUS_KIND).split(b"\n", 1)
    relaid = head + b"\n" + json.dumps(json.loads(body), indent=3).encode()  # whitespace only
    applied: list[dict] = []
    service = follower("s3cret", applied)
    asyncio.run(service.receive(relaid))
    assert applied == [] and service.seal.num_refused == 1
    asyncio.run(service.receive(ours.sealed(BUS_KIND)))
    assert applied == [{"policy": "fcfs", "tenant_quotas": "acme=64"}]


def test_a_replayed_older_signed_document_is_ignored_by_the_stamp_rule(tmp_path):
    ours = router(tmp_path, "router-ours", "s3cret", OURS)
    ours.patch({"scheduler": {"policy": "fcfs"}})
    captured = ours.sealed(BUS_KIND)
    ours.patch({"scheduler": {"policy": "priority"}})
    applied: list[dict] = []
    service = follower("s3cret", applied)
    for data in (ours.sealed(BUS_KIND), captured):
        asyncio.run(service.receive(data))
    assert applied == [{"policy": "priority"}]


def test_without_a_secret_documents_are_plain_as_before_and_unverified_is_warned_once(tmp_path, _logs):
    a = router(tmp_path, "router-a", "", OURS)
    b = router(tmp_path, "router-b", "", {})
    a.patch({"keys": {"sk-globex-000001": "globex"}, "scheduler": {"policy": "fcfs"}})
    assert a.sealed(BUS_KIND) == a.document.bus_payload()  # the bytes sent before signing existed
    assert a.sealed(ROUTER_BUS_KIND) == a.document.router_payload()
    b.adopt(a.sealed(ROUTER_BUS_KIND))
    b.adopt(a.sealed(ROUTER_BUS_KIND))
    assert b.keys.authenticate("sk-globex-000001") == "globex"
    assert [e["service"] for e in _logs if e["event"] == "live_settings_unverified"] == ["router"]


def test_without_a_secret_a_signed_document_is_read_unverified(tmp_path):
    signed = router(tmp_path, "router-a", "s3cret", OURS)
    signed.patch({"scheduler": {"policy": "fcfs"}})
    applied: list[dict] = []
    asyncio.run(follower("", applied).receive(signed.sealed(BUS_KIND)))
    assert applied == [{"policy": "fcfs"}]


def test_refusals_are_logged_once_per_period_per_reason(tmp_path, _logs):
    ours = router(tmp_path, "router-ours", "s3cret", OURS)
    theirs = router(tmp_path, "router-theirs", "other", THEIRS)
    for _ in range(5):  # a foreign router republishing
        with pytest.raises(UnverifiedDocument):
            ours.adopt(theirs.sealed(ROUTER_BUS_KIND))
    assert len([e for e in _logs if e["event"] == "live_settings_peer_refused"]) == 1


def test_the_secret_never_travels_and_the_key_is_derived():
    seal = DocumentSeal("s3cret-value", "router")
    doc = LiveDocument.parse({"version": 3, "scheduler": {"policy": "fcfs"}}).bus_document()
    data = seal.seal(BUS_KIND, doc, "router-1")
    assert b"s3cret-value" not in data
    source, sent_at, signature, body = split_signed(data)
    with_secret = hmac.new(b"s3cret-value", signed_bytes(BUS_KIND, source, sent_at, body), hashlib.sha256)
    assert signature != with_secret.hexdigest()
    assert seal.signature(BUS_KIND, source, sent_at, body) == signature
