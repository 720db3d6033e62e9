"""The live-settings document: what may change while the mesh runs, as one JSON object.

    {"version": 7,
     "keys":      {"sk-ops": {"tenant": "ops", "role": "admin"}, "sk-a": {"tenant": "acme"}},
     "scheduler": {"policy": "fcfs", "tenant_quotas": "acme=64", "executor_overcommit": 2},
     "executor":  {"tenant_partitions": "acme=32:16"}}

A setting is named and written as its ``weft up`` flag's value (``--tenant-quotas
acme=64`` is ``"tenant_quotas": "acme=64"``). A setting absent from the document is the
service's start-up value (its flag or ``WEFT_*`` variable): the document holds overrides,
and a JSON merge patch (RFC 7386) that sets one to ``null`` returns it to the flag's value.
``keys`` is the keys file (services/router/auth.py); it lives in the router and never
travels on the bus.

NOTE: routers write, newest wins. Only routers hold the whole document (from the
``--settings`` file, the keys file and the admin API); a router validates a change as a
whole (all or nothing; ``SettingsError`` names the field), bumps ``version``, stamps it
and publishes it without keys on ``weft.settings.<router>``, again every few seconds so
that a service that starts late or missed one converges. Kubernetes runs several routers,
each republishing, so every document carries a stamp and the newest one wins everywhere::

    stamp = (updated_at, version, writer)   compared in that order: a later change wins,
                                            the same second goes to the higher version,
                                            then to the larger writer id (a tie-break only)

A service that (re)connects asks for the document at once (``WANT_KIND``), so it does not
serve a republish period on its start-up values. A service applies its section (``SettingsFollower``) only from a document newer than the
one it runs, by swapping whole objects its owners hold, and reports the version it runs on
the gauge ``weft_settings_version{service}``; one that refuses a section (a partition table
larger than its pool) keeps the old one and its old version, so ``weft ps`` / ``weft top``
show it lagging, and tries again when the document is republished. A router that hears a
newer document from another router adopts it, keys included (services/router/live_settings.py).
With a mesh secret, both subjects carry signed documents and an unsigned or mis-signed one
is refused everywhere (settings_signing.py, which also says why replay gains nothing).
The services re-check a section with their own parsers; the checks here
(settings_checks.py) are the shape of each value, so a typo is a 400 at the router.
"""
from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import structlog

from services.mesh import mesh_auth, metrics
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.settings_checks import LIVE_SETTINGS, check_number
from services.mesh.rate_limited_log import RateLimitedLog
from services.mesh.settings_signing import REFUSAL_LOG_INTERVAL_S, DocumentSeal, UnverifiedDocument

log = structlog.get_logger(__name__)

BUS_KIND = "settings"  # subject weft.settings.<router name> (nats_auth.py: only the router publishes)
SETTINGS_VERSION = metrics.gauge("weft_settings_version",
                                 "Version of the live-settings document this service runs (docs/live_config.md).",
                                 ["service"])
ROUTER_BUS_KIND = "routersettings"  # weft.routersettings.<router>: the whole document, keys included, routers only
# weft.settingswant.<service>: a follower that has just (re)connected asks the routers for the
# document now, instead of serving on its start-up values until the next periodic republish.
# The body is empty and never read: an ask can only make a router publish sooner
# (RouterLiveSettings answers at most once per ANSWER_GAP_S, however many ask).
WANT_KIND = "settingswant"
ROLES = ("tenant", "admin")
# A stamp further ahead of a service's own clock than this was written by a clock that runs
# fast (SettingsFollower.receive): it must not hold the service once that router is gone.
MAX_CLOCK_AHEAD_S = 60.0
STAMP_FIELDS = ("updated_at", "writer", "origin")  # set by the router that made the change, never by a patch
# What made a document: a router's files as it started ("files"), or a change while running.
ORIGINS = ("files", "admin_api", "reload")


class SettingsError(ValueError):
    """A document or patch that cannot apply; ``field`` names the setting (``scheduler.policy``)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


# -- the document -------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyEntry:
    tenant: str
    role: str = "tenant"  # "admin": may read and change the live settings


@dataclass(frozen=True)
class LiveDocument:
    """One immutable version of the live settings. Build with ``parse`` or ``merged``."""

    version: int = 0
    keys: Mapping[str, KeyEntry] = field(default_factory=dict)
    sections: Mapping[str, Mapping[str, object]] = field(default_factory=dict)  # overrides only
    updated_at: float = 0.0  # unix seconds of the change (0: a router's files, not claimed yet)
    writer: str = ""  # the router that made it (RouterLiveSettings.writer)
    origin: str = "files"  # one of ORIGINS; kept when another router adopts the document

    @property
    def stamp(self) -> tuple[float, int, str]:
        """What "newer" means between two documents (the module's NOTE)."""
        return (self.updated_at, self.version, self.writer)

    @classmethod
    def parse(cls, value: object, *, keys_required: bool = False) -> LiveDocument:
        """A whole document from decoded JSON; raises SettingsError naming the field."""
        if not isinstance(value, dict):
            raise SettingsError("(document)", "must be a JSON object")
        unknown = sorted(set(value) - {"version", "keys", *STAMP_FIELDS, *LIVE_SETTINGS})
        if unknown:
            raise SettingsError(unknown[0], f"not a live setting section; sections: "
                                            f"{', '.join(LIVE_SETTINGS)} (and version, keys)")
        version = value.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise SettingsError("version", f"must be an integer >= 0, got {version!r}")
        updated_at, writer = value.get("updated_at", 0.0), value.get("writer", "")
        if check_number(updated_at) is not None:
            raise SettingsError("updated_at", f"must be unix seconds >= 0, got {updated_at!r}")
        if not isinstance(writer, str):
            raise SettingsError("writer", f"must be a string, got {writer!r}")
        origin = value.get("origin", "files")
        if origin not in ORIGINS:
            raise SettingsError("origin", f"must be one of {', '.join(ORIGINS)}, got {origin!r}")
        keys = parse_keys(value.get("keys", {}))
        sections: dict[str, Mapping[str, object]] = {}
        for section, checks in LIVE_SETTINGS.items():
            given = value.get(section, {})
            if not isinstance(given, dict):
                raise SettingsError(section, "must be a JSON object of setting -> value")
            for name, setting in given.items():
                where = f"{section}.{name}"
                if name not in checks:
                    raise SettingsError(where, f"not a live setting; live in {section}: {', '.join(checks)} "
                                               "(docs/live_config.md lists the restart-only ones)")
                problem = checks[name](setting)
                if problem:
                    raise SettingsError(where, problem)
            if given:
                sections[section] = MappingProxyType(dict(given))
        return cls(version, MappingProxyType(keys), MappingProxyType(sections), float(updated_at), writer, origin)

    def merged(self, patch: object) -> LiveDocument:
        """This document with a JSON merge patch applied and validated as a whole; the
        version is NOT bumped here (the caller's ``with_version``)."""
        if not isinstance(patch, dict):
            raise SettingsError("(patch)", "a merge patch must be a JSON object")
        stamped = sorted(set(patch) & set(STAMP_FIELDS))
        if stamped:
            raise SettingsError(stamped[0], "is set by the router that makes the change, not by a patch")
        return LiveDocument.parse(merge_patch(self.to_json(), patch))

    def with_version(self, version: int) -> LiveDocument:
        return LiveDocument(version, self.keys, self.sections, self.updated_at, self.writer, self.origin)

    def stamped(self, version: int, updated_at: float, writer: str, origin: str) -> LiveDocument:
        return LiveDocument(version, self.keys, self.sections, updated_at, writer, origin)

    def stamp_json(self) -> dict:
        return {"updated_at": self.updated_at, "writer": self.writer, "origin": self.origin}

    def to_json(self, *, key_ids: bool = False) -> dict:
        """The settings (no stamp); ``key_ids``: each key shown as ``key_id(key)``."""
        keys = {(key_id(k) if key_ids else k): {"tenant": e.tenant, "role": e.role}
                for k, e in self.keys.items()}
        return {"version": self.version, "keys": keys,
                **{name: dict(values) for name, values in self.sections.items()}}

    def bus_document(self) -> dict:
        """What goes on weft.settings: everything but the keys (sealed: settings_signing.py)."""
        return {"version": self.version, **self.stamp_json(), **{n: dict(v) for n, v in self.sections.items()}}

    def router_document(self) -> dict:
        """What goes on weft.routersettings (routers only): the whole document, keys included."""
        return {**self.to_json(), **self.stamp_json()}

    def bus_payload(self) -> bytes:
        """``bus_document`` as sent without a mesh secret (unsigned)."""
        return json.dumps(self.bus_document(), sort_keys=True).encode()

    def router_payload(self) -> bytes:
        """``router_document`` as sent without a mesh secret (unsigned)."""
        return json.dumps(self.router_document(), sort_keys=True).encode()

    def same_settings(self, other: LiveDocument) -> bool:
        return self.to_json() | {"version": 0} == other.to_json() | {"version": 0}


def parse_keys(value: object) -> dict[str, KeyEntry]:
    """``{key: tenant}`` or ``{key: {"tenant": t, "role": "admin"}}``; SettingsError naming the key."""
    if not isinstance(value, dict):
        raise SettingsError("keys", "must be a JSON object of key -> tenant")
    out: dict[str, KeyEntry] = {}
    for key, entry in value.items():
        where = f"keys.{redacted(key)}"
        if not key or any(c.isspace() for c in key):
            raise SettingsError(where, "a key must be non-empty with no whitespace")
        if isinstance(entry, str):
            entry = {"tenant": entry}
        if not isinstance(entry, dict) or set(entry) - {"tenant", "role"}:
            raise SettingsError(where, "must be a tenant name or {\"tenant\": ..., \"role\": ...}")
        tenant, role = entry.get("tenant"), entry.get("role", "tenant")
        if not isinstance(tenant, str) or not tenant or any(c.isspace() for c in tenant):
            raise SettingsError(f"{where}.tenant", "must be a non-empty name with no whitespace")
        if role not in ROLES:
            raise SettingsError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        out[key] = KeyEntry(tenant, role)
    return out


def redacted(key: str) -> str:
    """A key as logs and error fields show it: its first 4 characters."""
    return key[:4] + "…" if len(key) > 4 else "…"


KEY_ID_PREFIX_MIN_CHARS = 12  # shorter keys show no characters of their own


def key_id(key: str) -> str:
    """A key as the admin API lists it: its first 4 characters (keys of 12 or more) and
    the first 12 hex digits of its SHA-256, ``sk-a…3f2a9c1d0b7e``. Distinct keys that share
    a prefix stay apart, and an operator checks a key with
    ``printf %s "$KEY" | sha256sum | cut -c1-12``; the key itself cannot be read back."""
    prefix = key[:4] if len(key) >= KEY_ID_PREFIX_MIN_CHARS else ""
    return f"{prefix}…{hashlib.sha256(key.encode('utf-8', 'surrogateescape')).hexdigest()[:12]}"


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386 JSON merge patch: objects merge recursively, null removes, the rest replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = merge_patch(out.get(name), value)
    return out


def decode_bus_payload(data: bytes, seal: DocumentSeal, kind: str = BUS_KIND) -> LiveDocument:
    """A document heard on ``weft.<kind>``, opened with ``seal``: UnverifiedDocument when
    its signature fails under a mesh secret, SettingsError when malformed. Keys travel
    only between routers (``ROUTER_BUS_KIND``), never on weft.settings."""
    body = seal.open(kind, data)  # checked before it is parsed (settings_signing.py)
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise SettingsError("(document)", f"not JSON: {exc}") from None
    if isinstance(value, dict) and "keys" in value and kind != ROUTER_BUS_KIND:
        raise SettingsError("keys", "never travels on the bus")
    return LiveDocument.parse(value)


# -- a service following the router's documents ------------------------------------------
Apply = Callable[[dict[str, object]], Awaitable[None] | None]


class SettingsFollower:
    """Hands this service's section of each newer document to ``apply`` (which swaps whole
    objects, or raises to refuse it) and reports the version it runs.

    A document counts as handled only once ``apply`` succeeded: one it refused (ValueError:
    the section does not fit this service) or that failed (any other error) is logged with
    the reason and tried again when it is republished. An older document (a router still
    republishing what it had before another router's change) is ignored, unless the one in
    force is stamped more than ``MAX_CLOCK_AHEAD_S`` ahead of this service's clock (its
    router's clock ran fast) and the older one was made after it was last heard: the routers
    that replaced a fast one are followed at once, not once this clock reaches its stamp.
    With a mesh secret, an unsigned or mis-signed document is refused before any of this
    (settings_signing.py) and the document in force stays."""

    def __init__(self, service: str, section: str, apply: Apply, clock: Callable[[], float] = time.time,
                 security: MeshSecurity | None = None) -> None:
        """``security``: whose mesh secret documents must be signed with (default: this
        process's, ``mesh_auth.current()``; no secret: unverified development mode)."""
        self.service = service
        self.section = section
        self._apply = apply
        self._clock = clock  # unix seconds
        self.version = 0
        self.stamp: tuple[float, int, str] | None = None  # of the document in force; None: none yet
        self._heard_at = 0.0  # when the document in force was last received (this clock)
        self._applied: dict[str, object] = {}  # this service's overrides now in force
        self._failed: tuple[tuple, str] | None = None  # (stamp, reason) of the last failure, logged once
        # signs nothing here; opens what is heard (settings_signing.py)
        self.seal = DocumentSeal((security if security is not None else mesh_auth.current()).secret, service)
        # a malformed document is republished every few seconds (a newer router's new setting
        # during a rolling upgrade) or flooded without a secret: one line per period
        self._log_malformed = RateLimitedLog("live_settings_malformed", REFUSAL_LOG_INTERVAL_S, logger=log)
        SETTINGS_VERSION.labels(service).set(0)

    async def subscribe(self, bus) -> None:
        """Follow ``bus``'s documents, and ask the routers for theirs on every connect (once
        subscribed, so the answer cannot pass the subscription): a service that starts, or
        comes back after a NATS outage, runs the document within a round trip, not after
        the next periodic republish. Call before or after ``bus.start()``."""
        await bus.subscribe_documents(BUS_KIND, self.receive, screen=functools.partial(self.seal.admits, BUS_KIND),
                                      order=self.seal.sent_at)
        bus.on_connect(functools.partial(self.ask, bus))
        if bus.connected:
            await self.ask(bus)

    async def ask(self, bus) -> None:
        """Ask the routers to publish the document now (``WANT_KIND``); dropped silently
        while NATS is down (the next connect asks again)."""
        await bus.publish_document(WANT_KIND, b"")

    async def receive(self, data: bytes) -> bool:
        """Apply a document from the bus. True when it was genuine (signed and well formed,
        whether or not it changed anything): the document inbox lets such a sender's subject
        through a flood of junk on other subjects (services/mesh/document_inbox.py)."""
        try:
            doc = decode_bus_payload(data, self.seal)
        except UnverifiedDocument:
            return False  # logged and counted by the seal; the document in force stays
        except SettingsError as exc:
            self._log_malformed("malformed", service=self.service, error=str(exc))
            return False
        now = self._clock()
        if self.stamp is not None and doc.stamp == self.stamp:
            self._heard_at = now  # the periodic republish of what runs
            return True
        if self.stamp is not None and doc.stamp < self.stamp and not (
                self.stamp[0] > now + MAX_CLOCK_AHEAD_S >= doc.updated_at > self._heard_at):
            return True  # an older document from another router
        overrides = dict(doc.sections.get(self.section, {}))
        if overrides != self._applied:
            try:
                result = self._apply(dict(overrides))
                if result is not None:
                    await result
            except Exception as exc:  # noqa: BLE001  (any failure: keep the old settings, retry on republish)
                self._log_failure(doc, exc)
                return True
            self._applied = overrides
        self.stamp, self.version, self._failed, self._heard_at = doc.stamp, doc.version, None, now
        SETTINGS_VERSION.labels(self.service).set(doc.version)
        log.info("live_settings_applied", service=self.service, version=doc.version, writer=doc.writer,
                 overrides=self._applied)
        return True

    def _log_failure(self, doc: LiveDocument, exc: Exception) -> None:
        """An error the first time a document fails with a reason, debug on each retry."""
        reason = str(exc) or type(exc).__name__
        event = "live_settings_refused" if isinstance(exc, ValueError) else "live_settings_apply_failed"
        repeat = self._failed == (doc.stamp, reason)
        self._failed = (doc.stamp, reason)
        (log.debug if repeat else log.error)(event, service=self.service, version=doc.version, error=reason,
                                             running_version=self.version, retry="when republished")
