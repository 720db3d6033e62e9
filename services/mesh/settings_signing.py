"""Signed live-settings documents: only a holder of the mesh secret can change a mesh's
settings or hand it API keys (services/mesh/live_settings.py, services/router/live_settings.py).

Two meshes pointed at one NATS server, or any client that may publish as a router, used
to exchange whole documents: a router adopted another mesh's API keys (its tenants could
call this mesh, this mesh's own keys were replaced) and every service applied its
policies. NATS credentials (nats_auth.py) are one lock; this is the second, as for
executor heartbeats (heartbeat_signing.py).

With a mesh secret, every document travels in an envelope::

    {"document": {...}, "sent_at": 1764620000.123, "signature": "<hex HMAC-SHA256>"}

    key       = HMAC-SHA256(key=secret, msg=b"weft/settings-signing/v1")   (never the secret itself)
    signed    = b"weft.settings.v1" 0x00 kind 0x00 "%.3f" % sent_at 0x00 canonical(document)
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)

``kind`` is the bus subject's kind (``settings``: no keys, for every service;
``routersettings``: keys included, routers only), so a document signed for one subject is
not valid on the other. The signature covers the document as decoded, re-encoded
canonically, so JSON whitespace and key order on the wire do not matter and what was
checked is exactly what is applied.

A receiver with the secret refuses an unsigned or mis-signed document: it is logged
``live_settings_peer_refused`` (reason ``unsigned`` / ``bad_signature``, at most once per
``REFUSAL_LOG_INTERVAL_S`` per reason) and counted in ``weft_settings_refused_total``,
and the receiver keeps the document it runs.

Replay: a captured signed document is one this mesh itself stamped. Stamps
(``LiveDocument.stamp``) are signed with it, and the newest stamp wins everywhere, so a
replayed older document is ignored like any router's stale republish; the newest one
replayed changes nothing. That alone left one hole (found by attack): a router restarted
with its files holds nothing newer than a change captured *before* a key was revoked, and
adopted it, reviving the key mesh-wide. So each publish signs its wall-clock ``sent_at``
(routers republish every few seconds, each time sealed afresh), and a receiver refuses an
envelope sent more than ``MAX_AGE_S`` ago or that far ahead of its own clock (reason
``stale``): a capture is good for a minute at most. The cost is a requirement on clocks:
hosts more than ``MAX_AGE_S`` apart refuse each other's documents (logged and counted,
never applied), as TLS and JWT validity windows do.

Without a secret (development: ``weft up`` without ``WEFT_MESH_SECRET``) nothing is
signed or checked, byte for byte as before (a plain document), and the first document
heard logs ``live_settings_unverified`` once. A signed envelope is then read unverified.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from collections.abc import Callable

import structlog

from services.mesh import metrics
from services.mesh.rate_limited_log import RateLimitedLog

log = structlog.get_logger(__name__)

_KEY_CONTEXT = b"weft/settings-signing/v1"
_TAG = b"weft.settings.v1"
ENVELOPE_FIELDS = frozenset({"document", "sent_at", "signature"})
MAX_AGE_S = 60.0  # an envelope older (or that far ahead of this host's clock) is refused as stale
REFUSAL_LOG_INTERVAL_S = 10.0  # a foreign router republishes every few seconds: one line per reason and period
SETTINGS_REFUSED = metrics.counter("weft_settings_refused_total",
                                   "Live-settings documents refused for their signature (docs/live_config.md).",
                                   ["service", "reason"])


class UnverifiedDocument(Exception):
    """A document refused for its signature; ``reason`` is ``unsigned``, ``bad_signature``
    or ``stale`` (sent more than ``MAX_AGE_S`` from this host's now)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}: a live-settings document must be signed with this mesh's secret")
        self.reason = reason


def signing_key(secret: str) -> bytes:
    """The settings key derived from the mesh secret (ValueError for an empty one)."""
    if not secret:
        raise ValueError("an empty mesh secret signs nothing")
    return hmac.new(secret.encode(), _KEY_CONTEXT, hashlib.sha256).digest()


def canonical_bytes(kind: str, document: object, sent_at: float) -> bytes:
    """What the signature covers (module docstring). ValueError for a value JSON cannot
    carry canonically (NaN, infinity)."""
    if not isinstance(sent_at, (int, float)) or isinstance(sent_at, bool) or not math.isfinite(sent_at):
        raise ValueError("sent_at must be a finite number of seconds")
    body = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return b"\x00".join((_TAG, kind.encode(), b"%.3f" % sent_at, body.encode()))


def is_envelope(value: object) -> bool:
    return isinstance(value, dict) and set(value) == ENVELOPE_FIELDS


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

    def signature(self, kind: str, document: object, sent_at: float) -> str:
        return hmac.new(self._key, canonical_bytes(kind, document, sent_at), hashlib.sha256).hexdigest()

    def seal(self, kind: str, document: dict) -> bytes:
        """The bytes to publish on ``weft.<kind>``: the signed envelope, or without a
        secret the plain document exactly as before signing existed."""
        if self._key is None:
            return json.dumps(document, sort_keys=True).encode()
        sent_at = round(self.wall_clock(), 3)
        return json.dumps({"document": document, "sent_at": sent_at,
                           "signature": self.signature(kind, document, sent_at)}, sort_keys=True).encode()

    def open(self, kind: str, value: object) -> object:
        """The document in ``value`` (decoded JSON heard on ``weft.<kind>``), not yet
        validated. With a secret, raises UnverifiedDocument unless ``value`` is an envelope
        whose signature is valid (constant-time compare), after logging and counting the
        refusal. Without one, returns the document unverified (warned once)."""
        if self._key is None:
            if not self._warned_unverified:
                self._warned_unverified = True
                log.warning("live_settings_unverified", service=self.service,
                            detail="no mesh secret: any NATS client that may publish settings can change them "
                                   "(routers: hand over API keys); set WEFT_MESH_SECRET")
            return value["document"] if is_envelope(value) else value
        reason = self._problem(kind, value)
        if reason is not None:
            self.refuse(kind, reason)
        return value["document"]

    def refuse(self, kind: str, reason: str) -> None:
        """Count and log (rate-limited) a refused document, then raise UnverifiedDocument.
        Also for bytes that are not JSON at all under a secret (``unsigned``): any publisher
        can send those, so they must not cost a log line each."""
        self.num_refused += 1
        SETTINGS_REFUSED.labels(self.service, reason).inc()
        self._log_refusal(reason, service=self.service, kind=kind)
        raise UnverifiedDocument(reason)

    def _problem(self, kind: str, value: object) -> str | None:
        if not is_envelope(value):
            return "unsigned"
        given, sent_at = value["signature"], value["sent_at"]
        try:
            expected = self.signature(kind, value["document"], sent_at)
        except (ValueError, RecursionError, TypeError):
            return "bad_signature"  # NaN, a sent_at that is no number: nothing this mesh signs
        if not isinstance(given, str) or not hmac.compare_digest(given.encode("ascii", "replace"), expected.encode()):
            return "bad_signature"
        if abs(self.wall_clock() - sent_at) > MAX_AGE_S:
            return "stale"  # a capture replayed later, or this host's clock far from the sender's
        return None
