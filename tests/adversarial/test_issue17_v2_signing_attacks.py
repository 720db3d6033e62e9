"""Attacks on the v2 signed live-settings format (commit 7a7e4c0: settings_signing.py's header
line over the raw bytes, document_inbox.py's ``screen``), without processes or a network.

A hostile NATS client holding a router's NATS login but not the mesh secret crafts header
lines at and past every bound of ``_HEADER_RE`` / ``MAX_HEADER_BYTES``, plays with the clock
and the subject, and replays genuine documents it captured; an unlucky operator runs hosts
whose clocks differ. What must hold: nothing unsigned takes a slot or changes a setting,
every refusal is counted once, and a router's waiting change is not superseded by anything
a client without the secret can send (the commit's promise: "junk or a replay on a
router's own subject no longer supersedes its waiting change").

Every wait is on a condition with a deadline (tests/waiting.py)."""
from __future__ import annotations

import asyncio
import functools
import json

import pytest
from structlog.testing import capture_logs

from services.mesh import metrics
from services.mesh.document_inbox import DocumentInbox
from services.mesh.live_settings import BUS_KIND, ROUTER_BUS_KIND, SettingsFollower
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.settings_signing import (MAX_AGE_S, MAX_HEADER_BYTES, DocumentSeal, UnverifiedDocument,
                                            split_signed)
from services.router.auth import KeyStore
from services.router.live_settings import LiveOptions, RouterLiveSettings
from tests import waiting

DEADLINE_S = 10.0
SECRET = "issue17-v2-attack-secret"
NOW = 1_764_680_000.0  # the receivers' wall clock (unix seconds), fixed unless a test moves it
KEYS = {"sk-ops-admin-0001": {"tenant": "ops", "role": "admin"}, "sk-acme-tenant-01": "acme"}

until = functools.partial(waiting.until, deadline_s=DEADLINE_S)  # this file's own bound


def refused(service: str, reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("weft_settings_refused_total",
                                             {"service": service, "reason": reason}) or 0.0


def dropped(kind: str, reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("weft_documents_dropped_total", {"kind": kind, "reason": reason}) or 0.0


def sender(source_clock: float = NOW, secret: str = SECRET) -> DocumentSeal:
    return DocumentSeal(secret, "router", wall_clock=lambda: source_clock)


def receiver(service: str = "scheduler", now: list[float] | None = None, secret: str = SECRET) -> DocumentSeal:
    clock = now if now is not None else [NOW]
    return DocumentSeal(secret, service, wall_clock=lambda: clock[0])


def framed(source: bytes, sent_at: bytes, signature: bytes, body: bytes) -> bytes:
    return b"weft-signed/2 %s %s %s\n%s" % (source, sent_at, signature, body)


def signed_by_key(kind: str, source: str, sent_at: bytes, body: bytes) -> bytes:
    """A frame with a correct HMAC under SECRET, whatever its header's shape: what the
    receivers must still refuse when the header breaks the format (a key holder's bug, or a
    format bound that differs between sender and receiver)."""
    sig = sender().signature(kind, source, sent_at, body)
    return framed(source.encode(), sent_at, sig.encode(), body)


def upper_signature(data: bytes) -> bytes:
    head, body = data.split(b"\n", 1)
    magic, source, sent_at, sig = head.split(b" ")
    return b" ".join((magic, source, sent_at, sig.upper())) + b"\n" + body


BODY = json.dumps({"version": 3, "updated_at": NOW, "writer": "w", "origin": "admin_api",
                   "scheduler": {"policy": "fcfs"}}, sort_keys=True).encode()


# -- the header line at and past its bounds --------------------------------------------------
def test_the_longest_header_the_format_allows_is_exactly_max_header_bytes_and_is_admitted():
    """A 128-character source and a 12-digit sent_at: the header is 225 bytes, the slice
    ``split_signed`` matches on; one byte more anywhere and it would not be seen."""
    source = "r" * 128
    clock = 999_999_999_999.999
    data = sender(clock).seal(BUS_KIND, json.loads(BODY), source)
    header = data.split(b"\n", 1)[0] + b"\n"
    assert len(header) == MAX_HEADER_BYTES
    assert split_signed(data) is not None
    assert receiver(now=[clock]).problem(BUS_KIND, data, f"weft.{BUS_KIND}.{source}") is None


@pytest.mark.parametrize("name, data", [
    ("source of 129 characters", signed_by_key(BUS_KIND, "r" * 129, b"%.3f" % NOW, BODY)),
    ("sent_at of 13 integer digits", signed_by_key(BUS_KIND, "router-1", b"1%012d.000" % 0, BODY)),
    ("sent_at with leading zeros past 12 digits", signed_by_key(BUS_KIND, "router-1", b"000%.3f" % NOW, BODY)),
    ("sent_at with four decimals", signed_by_key(BUS_KIND, "router-1", b"%.4f" % NOW, BODY)),
    ("sent_at with no decimals", signed_by_key(BUS_KIND, "router-1", b"%d" % NOW, BODY)),
    ("negative sent_at", signed_by_key(BUS_KIND, "router-1", b"-%.3f" % NOW, BODY)),
    ("upper-case signature", upper_signature(signed_by_key(BUS_KIND, "router-1", b"%.3f" % NOW, BODY))),
    ("NUL inside the source", signed_by_key(BUS_KIND, "router\x00-1", b"%.3f" % NOW, BODY)),
    ("dot inside the source", signed_by_key(BUS_KIND, "router.1", b"%.3f" % NOW, BODY)),
    ("non-ASCII source", signed_by_key(BUS_KIND, "rout\u00e9r-1", b"%.3f" % NOW, BODY)),
    ("empty source", signed_by_key(BUS_KIND, "", b"%.3f" % NOW, BODY)),
    ("no newline in the first 225 bytes", b"weft-signed/2 " + b"r" * 600 + b"\n" + BODY),
    ("no newline at all, 512 KiB", b"weft-signed/2 router-1 " + b"9" * (512 * 1024)),
    ("tab instead of a space", signed_by_key(BUS_KIND, "router-1", b"%.3f" % NOW, BODY).replace(b" ", b"\t", 1)),
    ("two spaces", signed_by_key(BUS_KIND, "router-1", b"%.3f" % NOW, BODY).replace(b" ", b"  ", 1)),
    ("leading byte", b" " + signed_by_key(BUS_KIND, "router-1", b"%.3f" % NOW, BODY)),
    ("leading BOM", b"\xef\xbb\xbf" + signed_by_key(BUS_KIND, "router-1", b"%.3f" % NOW, BODY)),
    ("version 1 magic", signed_by_key(BUS_KIND, "router-1", b"%.3f" % NOW, BODY).replace(b"/2", b"/1", 1)),
    ("version 3 magic", signed_by_key(BUS_KIND, "router-1", b"%.3f" % NOW, BODY).replace(b"/2", b"/3", 1)),
    ("CR before the newline", signed_by_key(BUS_KIND, "router-1", b"%.3f" % NOW, BODY).replace(b"\n", b"\r\n", 1)),
])
def test_a_header_outside_the_format_is_unsigned_even_with_a_correct_hmac(name, data):
    seal = receiver()
    subject = f"weft.{BUS_KIND}.router-1"
    assert seal.problem(BUS_KIND, data, subject) == "unsigned", name
    assert not seal.admits(BUS_KIND, subject, data), name
    with pytest.raises(UnverifiedDocument, match="unsigned"):
        seal.open(BUS_KIND, data)


def test_sent_at_text_is_signed_as_written_so_an_equal_number_in_other_digits_is_a_bad_signature():
    """``01764680000.000`` is the same number as ``1764680000.000`` (leading zero, within 12
    digits): the receiver must hash the text it received, not a re-formatted float."""
    genuine = sender().seal(BUS_KIND, json.loads(BODY), "router-1")
    source, sent_at, sig, body = split_signed(genuine)
    for other in (b"0" + sent_at, sent_at[:-1] + b"0" if not sent_at.endswith(b"0") else sent_at[:-1] + b"1"):
        assert float(other) - float(sent_at) < 1
        forged = framed(source.encode(), other, sig.encode(), body)
        assert receiver().problem(BUS_KIND, forged, "weft.settings.router-1") == "bad_signature"


def test_an_embedded_nul_in_the_body_cannot_move_bytes_between_the_signed_fields():
    """``signed_bytes`` joins the fields with NUL; the body is last and the other fields
    cannot hold a NUL, so no two distinct (source, sent_at, body) sign the same bytes."""
    seal = sender()
    body = b'{"version": 1}\x00router-2\x00'
    genuine = signed_by_key(BUS_KIND, "router-1", b"%.3f" % NOW, body)
    assert receiver().problem(BUS_KIND, genuine, "weft.settings.router-1") is None
    _, sent_at, sig, _ = split_signed(genuine)
    shifted = framed(b"router-1", sent_at, sig.encode(), body[:-1])
    assert receiver().problem(BUS_KIND, shifted, "weft.settings.router-1") == "bad_signature"
    assert seal.signature(BUS_KIND, "router-1", sent_at, body) != seal.signature(ROUTER_BUS_KIND, "router-1",
                                                                                 sent_at, body)


# -- the clock ---------------------------------------------------------------------------------
@pytest.mark.parametrize("offset_s, admitted", [
    (-MAX_AGE_S - 1, False), (-MAX_AGE_S + 1, True), (0.0, True),
    (MAX_AGE_S - 1, True), (MAX_AGE_S + 1, False), (10 * 365 * 86400.0, False), (-NOW, False),
])
def test_a_document_from_a_clock_more_than_max_age_away_either_way_is_stale(offset_s, admitted):
    data = sender(NOW + offset_s).seal(BUS_KIND, json.loads(BODY), "router-1")
    seal = receiver()
    assert seal.admits(BUS_KIND, "weft.settings.router-1", data) is admitted
    assert seal.problem(BUS_KIND, data) == (None if admitted else "stale")


def test_the_largest_sent_at_the_header_allows_is_stale_not_an_error():
    data = signed_by_key(BUS_KIND, "router-1", b"999999999999.999", BODY)
    assert receiver().problem(BUS_KIND, data, "weft.settings.router-1") == "stale"


def test_a_stale_or_wrong_subject_document_costs_no_hmac():
    """The cheap checks run first: a flood of current-looking headers on the wrong subject,
    or of old ones, never reaches the HMAC over the body (the signature method is not called)."""
    seal = receiver()
    calls = []
    seal.signature = lambda *a: calls.append(a) or "0" * 64
    stale = signed_by_key(BUS_KIND, "router-1", b"%.3f" % (NOW - 3600), BODY)
    fresh = signed_by_key(BUS_KIND, "router-1", b"%.3f" % NOW, BODY)
    assert seal.problem(BUS_KIND, stale, "weft.settings.router-1") == "stale"
    assert seal.problem(BUS_KIND, fresh, "weft.settings.router-2") == "wrong_subject"
    assert calls == []


# -- the subject --------------------------------------------------------------------------------
@pytest.mark.parametrize("subject", [
    "weft.settings.router-2", "weft.settings.router-1.extra", "weft.settings.router-1.", "weft.settings.*",
    "weft.settings.>", "weft.settings", "weft.settings.", "WEFT.settings.router-1", "weft.Settings.router-1",
    "weft.routersettings.router-1", "weft.settings.router-1 ", " weft.settings.router-1", "weft..settings.router-1",
    "weft.settings.router-10", "weft.settings.route", "",
])
def test_a_genuine_document_heard_on_any_other_subject_is_wrong_subject(subject):
    data = sender().seal(BUS_KIND, json.loads(BODY), "router-1")
    seal = receiver()
    assert seal.problem(BUS_KIND, data, subject) == "wrong_subject"
    assert not seal.admits(BUS_KIND, subject, data)
    assert seal.problem(BUS_KIND, data, "weft.settings.router-1") is None


# -- counting: each refusal once -------------------------------------------------------------
async def _accept(handled: list, data: bytes) -> bool:
    handled.append(data)
    return True


def test_a_document_refused_by_the_screen_is_counted_once_and_never_reaches_the_handler():
    """One refused document: +1 in weft_settings_refused_total (the seal) and +1 in
    weft_documents_dropped_total{refused} (the inbox), one log line each; the handler, which
    opens documents with the same seal, never sees it (no second count)."""
    async def scenario() -> int:
        seen: list[bytes] = []

        async def handler(data: bytes) -> bool:
            seen.append(data)
            return await follower.receive(data)

        inbox = DocumentInbox(BUS_KIND, handler, clock=lambda: 0.0,
                              screen=functools.partial(follower.seal.admits, BUS_KIND))
        try:
            assert not inbox.offer("weft.settings.router-1", forged)
            genuine = sender().seal(BUS_KIND, json.loads(BODY), "router-1")
            assert inbox.offer("weft.settings.router-1", genuine)
            await until(lambda: inbox.num_handled == 1, "the genuine document handled")
            assert seen == [genuine]
            return len(seen)
        finally:
            await inbox.close()

    with capture_logs() as logs:
        applied: list[dict] = []
        follower = SettingsFollower("scheduler", "scheduler", applied.append, security=MeshSecurity(secret=SECRET))
        follower.seal.wall_clock = lambda: NOW
        forged = framed(b"router-1", b"%.3f" % NOW, b"ab" * 32, BODY)
        before = refused("scheduler", "bad_signature"), dropped(BUS_KIND, "refused")
        asyncio.run(scenario())
    assert follower.seal.num_refused == 1
    assert refused("scheduler", "bad_signature") - before[0] == 1
    assert dropped(BUS_KIND, "refused") - before[1] == 1
    assert [e["event"] for e in logs if e["event"] in ("live_settings_peer_refused", "documents_dropped")] == \
           ["live_settings_peer_refused", "documents_dropped"]
    assert applied == [{"policy": "fcfs"}]


def test_a_document_that_goes_stale_while_it_waits_is_refused_once_by_the_handler():
    """An operator's hosts 59 s apart: admitted by the screen, stale a moment later when the
    worker opens it (the clock moved on while it waited). Counted once (``stale``), not once
    by the screen and once by the handler, and not treated as accepted."""
    now = [NOW]
    applied: list[dict] = []
    follower = SettingsFollower("scheduler", "scheduler", applied.append, security=MeshSecurity(secret=SECRET))
    follower.seal.wall_clock = lambda: now[0]
    data = sender(NOW - MAX_AGE_S + 0.5).seal(BUS_KIND, json.loads(BODY), "router-1")
    before = refused("scheduler", "stale")

    async def scenario() -> None:
        gate = asyncio.Event()
        results: list[bool] = []

        async def handler(data: bytes) -> bool:
            await gate.wait()
            results.append(await follower.receive(data))
            return results[-1]

        inbox = DocumentInbox(BUS_KIND, handler, clock=lambda: 0.0,
                              screen=functools.partial(follower.seal.admits, BUS_KIND))
        try:
            assert inbox.offer("weft.settings.router-1", data)
            await until(lambda: not inbox._pending, "the worker to take the document")
            now[0] += 1.0
            gate.set()
            await until(lambda: results, "the document handled")
            assert results == [False]
            assert "weft.settings.router-1" not in inbox._accepted
        finally:
            await inbox.close()

    asyncio.run(scenario())
    assert follower.seal.num_refused == 1 and refused("scheduler", "stale") - before == 1
    assert applied == []


def test_a_refused_document_leaves_its_subject_marked_accepted_for_the_overflow_rule():
    """Refused documents no longer reach the handler, so junk on a known router's subject
    cannot unmark it: the router still takes a slot from a never-accepted subject when full."""
    seal = receiver()

    async def scenario() -> list[bytes]:
        handled: list[bytes] = []
        gate = asyncio.Event()
        gate.set()

        async def handler(data: bytes) -> bool:
            await gate.wait()
            handled.append(data)
            return data.startswith(b"weft-signed/2")

        inbox = DocumentInbox(BUS_KIND, handler, clock=lambda: 0.0, max_subjects=2,
                              screen=functools.partial(seal.admits, BUS_KIND))
        r1 = sender().seal(BUS_KIND, json.loads(BODY), "router-1")
        r2 = sender().seal(BUS_KIND, json.loads(BODY), "router-2")
        r3 = sender().seal(BUS_KIND, json.loads(BODY), "router-3")
        r4 = sender().seal(BUS_KIND, json.loads(BODY), "router-4")
        try:
            assert inbox.offer("weft.settings.router-1", r1)
            await until(lambda: inbox.num_handled == 1, "router 1 accepted")
            for _ in range(50):  # junk on router 1's own subject: refused, router 1 stays known
                assert not inbox.offer("weft.settings.router-1", b"junk")
            gate.clear()
            assert inbox.offer("weft.settings.router-4", r4)  # holds the worker
            await until(lambda: not inbox._pending, "the worker to take router 4's document")
            assert inbox.offer("weft.settings.router-2", r2) and inbox.offer("weft.settings.router-3", r3)
            assert inbox.offer("weft.settings.router-1", r1)  # full: takes router 2's slot (never accepted)
            gate.set()
            await until(lambda: inbox.num_handled == 4, "the waiting documents handled")
            return handled
        finally:
            await inbox.close()

    handled = asyncio.run(scenario())
    assert [split_signed(d)[0] for d in handled] == ["router-1", "router-4", "router-3", "router-1"]


# -- no secret ----------------------------------------------------------------------------------
def test_without_a_secret_a_signed_document_on_any_subject_is_read_with_its_header_dropped():
    """Development mode tells nothing apart (documented): the screen admits all and ``open``
    returns the body of a v2 document, whatever subject it came on."""
    bare = DocumentSeal("", "scheduler")
    data = sender().seal(BUS_KIND, json.loads(BODY), "router-1")
    assert bare.admits(BUS_KIND, "weft.settings.router-9", data)
    assert bare.open(BUS_KIND, data) == BODY
    assert bare.open(BUS_KIND, BODY) == BODY
    assert DocumentSeal("", "router").seal(BUS_KIND, json.loads(BODY), "router-1") == BODY


# -- a replay of the router's own earlier document on its own subject -----------------------------
def _router(tmp_path, name: str, wall: list[float]) -> RouterLiveSettings:
    folder = tmp_path / name
    folder.mkdir()
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    stamp = iter(range(10**6))
    live = RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file), LiveOptions(), writer=name,
                              clock=lambda: NOW - 3600 + next(stamp), security=MeshSecurity(secret=SECRET))
    live.seal.wall_clock = lambda: wall[0]
    live.claim()
    return live


@pytest.mark.parametrize("captured_ago_s", [30.0, MAX_AGE_S - 0.5])
def test_a_replay_of_a_routers_own_earlier_document_does_not_supersede_its_waiting_change(tmp_path,
                                                                                        captured_ago_s):
    """Found by attack on 7a7e4c0 (fixed: the inbox's ``order``). A client with a router's NATS login captures router 1's
    republish (genuine, signed, on router 1's own subject) and, after router 1's PATCH,
    publishes the capture again on that subject as fast as it can. The screen admits it
    (right subject, signature good, sent less than MAX_AGE_S ago) and it supersedes the
    change waiting in router 1's slot; the handler then ignores it (an older stamp; a capture
    almost MAX_AGE_S old is even refused as stale if the clock passes the bound while it
    waits). The change is dropped, and it is dropped on every republish for as long as
    the capture is fresh: a key revocation (PATCH) can be held off for up to a minute on
    every service. The inbox now drops a document sent before the one waiting on its subject
    (``older``), as ``EventBus.subscribe_documents`` is given it by every subscriber."""
    wall = [NOW - captured_ago_s]
    r1 = _router(tmp_path, "router-1", wall)
    captured = r1.sealed(BUS_KIND)  # the pre-change republish, captured off the wire
    wall[0] = NOW - 1.0
    r1.patch({"scheduler": {"policy": "fcfs"}, "keys": {"sk-acme-tenant-01": None}})
    change = r1.sealed(BUS_KIND)  # router 1's republish of its change
    applied: list[dict] = []
    follower = SettingsFollower("scheduler", "scheduler", applied.append, security=MeshSecurity(secret=SECRET))
    follower.seal.wall_clock = lambda: NOW
    subject = f"weft.settings.{r1.source}"

    async def scenario() -> bool:
        gate = asyncio.Event()

        async def handler(data: bytes) -> bool:
            await gate.wait()  # the worker is busy (handling a document, or its 3x pause)
            return await follower.receive(data)

        inbox = DocumentInbox(BUS_KIND, handler, clock=lambda: 0.0,
                              screen=functools.partial(follower.seal.admits, BUS_KIND), order=follower.seal.sent_at)
        try:
            assert inbox.offer(subject, captured)  # the replay flood's first copy is being handled
            await until(lambda: not inbox._pending, "the worker to take the first replay")
            assert inbox.offer(subject, change)  # router 1's change waits in its slot
            took_slot = inbox.offer(subject, captured)  # the next copy of the replay
            gate.set()
            await until(lambda: inbox.num_handled + inbox.num_dropped >= 3 and not inbox._pending,
                        "the slot emptied")
            return took_slot
        finally:
            await inbox.close()

    took_slot = asyncio.run(scenario())
    assert {"policy": "fcfs"} in applied, (
        f"router 1's change never reached the service: a replay of its own {captured_ago_s:.1f} s old "
        f"document superseded it in the inbox (the replay took the slot: {took_slot})")
