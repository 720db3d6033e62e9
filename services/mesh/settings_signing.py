"""Signed live-settings documents: only a holder of the mesh secret can change a mesh's
settings or hand it API keys (services/mesh/live_settings.py, services/router/live_settings.py).

Two meshes pointed at one NATS server, or any client that may publish as a router, used
to exchange whole documents: a router adopted another mesh's API keys (its tenants could
call this mesh, this mesh's own keys were replaced) and every service applied its
policies. NATS credentials (nats_auth.py) are one lock; this is the second, as for
executor heartbeats (heartbeat_signing.py).

With a mesh secret, every document travels behind one signed header line::

    weft-signed/2 <source> <sent_at> <signature>\n<body>

    body      = the document's JSON, exactly the bytes signed
    key       = HMAC-SHA256(key=secret, msg=b"weft/settings-signing/v1")   (never the secret itself)
    signed    = b"weft.settings.v2" 0x00 kind 0x00 source 0x00 sent_at 0x00 body
    sent_at   = seconds since the epoch as sent, "%.3f" (the text itself is signed)
    signature = 64 lower-case hex digits of HMAC-SHA256(key, signed)

The signature covers the raw bytes, so a receiver checks it before parsing anything: the
document inbox (document_inbox.py) screens what it hears with ``admits`` and a document
that fails never takes a slot. Before (v1: a JSON envelope signed over the document
re-encoded canonically) checking meant parsing, so the inbox kept every document unread
and junk published on a router's own subject superseded that router's pending document
(stop 26's "own-subject defect"). ``source`` is the publisher's bus name: the inbox also
refuses a genuine document heard on another publisher's subject (``wrong_subject``), so a
replayed capture cannot take a router's slot either.

``kind`` is the bus subject's kind (``settings``: no keys, for every service;
``routersettings``: keys included, routers only), so a document signed for one subject is
not valid on the other. What was checked is exactly what is parsed and applied. A v1
envelope is refused as ``unsigned``: a mesh that sets a secret upgrades its routers and
services together (docs/live_config.md).

A receiver with the secret refuses an unsigned or mis-signed document: it is logged
``live_settings_peer_refused`` (reason ``unsigned`` / ``bad_signature`` / ``stale`` /
``wrong_subject``, at most once per ``REFUSAL_LOG_INTERVAL_S`` per reason) and counted in
``weft_settings_refused_total``, and the receiver keeps the document it runs.

Replay: a captured signed document is one this mesh itself stamped. Stamps
(``LiveDocument.stamp``) are signed with it, and the newest stamp wins everywhere, so a
replayed older document is ignored like any router's stale republish; the newest one
replayed changes nothing. That alone left one hole (found by attack): a router restarted
with its files holds nothing newer than a change captured *before* a key was revoked, and
adopted it, reviving the key mesh-wide. So each publish signs its wall-clock ``sent_at``
(routers republish every few seconds, each time sealed afresh), and a receiver refuses an
document sent more than ``MAX_AGE_S`` ago or that far ahead of its own clock (reason
``stale``): a capture is good for a minute at most. The cost is a requirement on clocks:
hosts more than ``MAX_AGE_S`` apart refuse each other's documents (logged and counted,
never applied), as TLS and JWT validity windows do.

Without a secret (development: ``weft up`` without ``WEFT_MESH_SECRET``) nothing is
signed or checked, byte for byte as before (a plain document), and the first document
heard logs ``live_settings_unverified`` once. A signed document is then read unverified.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import time
from collections.abc import Callable

import structlog

from services.mesh import metrics
from services.mesh.rate_limited_log import RateLimitedLog
from services.mesh.subjects import NAME_RE

log = structlog.get_logger(__name__)

_KEY_CONTEXT = b"weft/settings-signing/v1"
_TAG = b"weft.settings.v2"
MAGIC = b"weft-signed/2"
# the header line, matched before anything is parsed or hashed: bounded and strict
_HEADER_RE = re.compile(rb"weft-signed/2 ([A-Za-z0-9_-]{1,128}) ([0-9]{1,12}\.[0-9]{3}) ([0-9a-f]{64})\n")
MAX_HEADER_BYTES = 14 + 129 + 17 + 65  # magic, source, sent_at, signature, their separators
MAX_AGE_S = 60.0  # a document sent longer ago (or that far ahead of this host's clock) is refused as stale
REFUSAL_LOG_INTERVAL_S = 10.0  # a foreign router republishes every few seconds: one line per reason and period
REFUSAL_REASONS = ("unsigned", "bad_signature", "stale", "wrong_subject")
SETTINGS_REFUSED = metrics.counter("weft_settings_refused_total",
                                   "Live-settings documents refused for their signature (docs/live_config.md).",
                                   ["service", "reason"])


class UnverifiedDocument(Exception):
    """A document refused for its signature; ``reason`` is one of REFUSAL_REASONS:
    ``unsigned``, ``bad_signature``, ``stale`` (sent more than ``MAX_AGE_S`` from this host's
    now) or ``wrong_subject`` (signed by one publisher, heard on another's subject)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}: a live-settings document must be signed with this mesh's secret")
        self.reason = reason


def signing_key(secret: str) -> bytes:
    """The settings key derived from the mesh secret (ValueError for an empty one)."""
    if not secret:
        raise ValueError("an empty mesh secret signs nothing")
    return hmac.new(secret.encode(), _KEY_CONTEXT, hashlib.sha256).digest()


def signed_bytes(kind: str, source: str, sent_at: bytes, body: bytes) -> bytes:
    """What the signature covers (module docstring)."""
    return b"\x00".join((_TAG, kind.encode(), source.encode(), sent_at, body))


def split_signed(data: bytes) -> tuple[str, bytes, str, bytes] | None:
    """(source, sent_at text, signature, body) of a signed document; None when ``data``
    does not start with a well-formed header line (module docstring)."""
    head = _HEADER_RE.match(data[:MAX_HEADER_BYTES])
    if head is None:
        return None
    source, sent_at, signature = head.groups()
    return source.decode(), sent_at, signature.decode(), data[head.end():]


def document_bytes(document: object) -> bytes:
    """A document as it travels (sorted keys). ValueError for a value JSON cannot carry (NaN)."""
    return json.dumps(document, sort_keys=True, allow_nan=False).encode()


class DocumentSeal:
    """Seals the documents one process sends and opens the ones it hears, under one
    mesh secret or none. Holds only the derived key and the log state."""

    def __init__(self, secret: str, service: str, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        """``service``: who opens (``router``, ``scheduler``...), for logs and the counter.
        ``wall_clock``: seconds since the epoch, for ``sent_at`` (shared by every host)."""
        self._key = signing_key(secret) if secret else None
        self.wall_clock = wall_clock
        self.service = service
        self._log_refusal = RateLimitedLog("live_settings_peer_refused", REFUSAL_LOG_INTERVAL_S, clock, log)
        self._warned_unverified = False
        self.num_refused = 0  # documents refused by this seal (the counter adds up every seal of a service)

    @property
    def verifies(self) -> bool:
        return self._key is not None

    def signature(self, kind: str, source: str, sent_at: bytes, body: bytes) -> str:
        return hmac.new(self._key, signed_bytes(kind, source, sent_at, body), hashlib.sha256).hexdigest()

    def seal(self, kind: str, document: dict, source: str) -> bytes:
        """The bytes ``source`` publishes on ``weft.<kind>.<source>``: the signed document,
        or without a secret the plain document exactly as before signing existed."""
        body = document_bytes(document)
        if self._key is None:
            return body
        if not NAME_RE.match(source) or len(source) > 128:
            raise ValueError(f"source {source!r} must be a bus name of at most 128 characters")
        sent_at = b"%.3f" % self.wall_clock()
        return b"%s %s %s %s\n%s" % (MAGIC, source.encode(), sent_at,
                                     self.signature(kind, source, sent_at, body).encode(), body)

    def problem(self, kind: str, data: bytes, subject: str | None = None) -> str | None:
        """Why ``data`` heard on ``weft.<kind>`` (on ``subject``, when known) is no document
        this mesh signed; None when it is one. Cheap checks first: the header line and the
        subject, then the clock, then one HMAC over the bytes."""
        parts = split_signed(data)
        if parts is None:
            return "unsigned"
        source, sent_at, given, body = parts
        if subject is not None and subject != f"weft.{kind}.{source}":
            return "wrong_subject"
        sent = float(sent_at)
        if not math.isfinite(sent) or abs(self.wall_clock() - sent) > MAX_AGE_S:
            return "stale"  # a capture replayed later, or this host's clock far from the sender's
        if not hmac.compare_digest(given.encode(), self.signature(kind, source, sent_at, body).encode()):
            return "bad_signature"
        return None

    def admits(self, kind: str, subject: str, data: bytes) -> bool:
        """The inbox's screen: whether ``data`` heard on ``subject`` may take a slot. Always
        True without a secret (nothing can be told apart); a refusal is counted and logged
        (rate-limited) like ``open``'s."""
        if self._key is None:
            return True
        reason = self.problem(kind, data, subject)
        if reason is None:
            return True
        self._count_refusal(kind, reason)
        return False

    def sent_at(self, data: bytes) -> float:
        """When ``data`` says it was sent (its header's ``sent_at``), for the inbox's order
        (document_inbox.py): 0.0 without a secret or a header, so the last one heard wins.
        Trusted only after ``admits`` (which checks that it is signed and fresh)."""
        parts = split_signed(data) if self._key is not None else None
        return float(parts[1]) if parts is not None else 0.0

    def open(self, kind: str, data: bytes) -> bytes:
        """The document's JSON bytes in ``data`` heard on ``weft.<kind>``, not yet parsed.
        With a secret, raises UnverifiedDocument unless ``data`` is signed with it (constant-
        time compare), after logging and counting the refusal. Without one, returns the
        document unverified (warned once), with a signed document's header line dropped."""
        if self._key is None:
            if not self._warned_unverified:
                self._warned_unverified = True
                log.warning("live_settings_unverified", service=self.service,
                            detail="no mesh secret: any NATS client that may publish settings can change them "
                                   "(routers: hand over API keys); set WEFT_MESH_SECRET")
            parts = split_signed(data)
            return data if parts is None else parts[3]
        reason = self.problem(kind, data)
        if reason is not None:
            self.refuse(kind, reason)
        return split_signed(data)[3]

    def refuse(self, kind: str, reason: str) -> None:
        """Count and log (rate-limited) a refused document, then raise UnverifiedDocument."""
        self._count_refusal(kind, reason)
        raise UnverifiedDocument(reason)

    def _count_refusal(self, kind: str, reason: str) -> None:
        self.num_refused += 1
        SETTINGS_REFUSED.labels(self.service, reason).inc()
        self._log_refusal(reason, service=self.service, kind=kind)
