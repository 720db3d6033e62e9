"""The router's side of live settings: the one writer of the document (services/mesh/live_settings.py).

    settings file ─┐                         ┌─▶ KeyStore.replace (this router's keys)
    keys file ─────┼─▶ RouterLiveSettings ───┤
    admin PATCH ───┘   (validate, version++)  └─▶ weft.settings.<source> on NATS (no keys),
                                                  again every ``republish_s``, and soon after
                                                  a follower that connects asks for it
                                                  (weft.settingswant: ``_on_want``)

SIGHUP re-reads both files. A PATCH is written back to the files it changes (atomically:
a temporary file renamed over the old one), so a later SIGHUP or restart keeps it; with
no file configured, or one that cannot be written (the keys Secret Kubernetes mounts
read-only; logged as ``live_settings_not_persisted``), it lives in memory, shared with the
other routers, until every router restarts. The version goes up by
one per change; a settings file may carry a higher one (``"version": 40``), which wins.

NOTE: several routers (Kubernetes' autoscaler runs 2-6). Each stamps its documents
(``updated_at``, its ``writer`` id, the version, and the ``origin``: its files, or a change
while running) and also sends its whole document, keys included, on
``weft.routersettings.<router>``, which only routers read (both signed under the mesh
secret when one is set: services/mesh/settings_signing.py). A router that hears a newer
document than its own (``LiveDocument.stamp``) adopts it, keys included, and republishes
it unchanged, so every router and every service converge on the newest change, whichever
replica took it::

    start: the document of its files, stamped 0 (older than anything claimed or changed)
      │ once NATS is connected (hearing nobody during an outage proves nothing),
      │ listen one republish period and a half: adopt another router's *change*
      │ (a PATCH or a SIGHUP reload, origin != files), never its files
      ▼
    claim: still our own document? stamp it now: our files are the newest files (a rolling
      │    restart with a new keys Secret), and a lone router restarted without a settings
      │    file is the truth again
      ▼
    republish forever; PATCH / SIGHUP stamp now; any newer document is adopted at once,
    except another router's files while we hold a change: a claim that raced the change
    (in flight as its listen window closed) makes us stamp the change again, after it

So a change made while running survives new replicas and rolling restarts; a file edited
for a rolling restart after such a change takes effect with SIGHUP (or a PATCH) on one
router. A document adopted from another router is not written to this router's files (a
Secret mount is read-only; the router that took the change wrote its own). Two PATCHes on
two replicas within one republish period: the later one wins everywhere, the other is
replaced (its caller got 200: ``If-Match`` guards a change within one replica only).

Settings read from the environment (until RouterConfig has them: docs/live_config.md):
``WEFT_SETTINGS_FILE``, ``WEFT_NATS_URL`` (the bus; empty: the document stays in this
router), ``WEFT_SETTINGS_REPUBLISH_S`` (default 2).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import math
import os
import re
import secrets
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from services.mesh import mesh_auth
from services.mesh.live_settings import (BUS_KIND, ROUTER_BUS_KIND, SETTINGS_VERSION, WANT_KIND, LiveDocument,
                                        SettingsError, decode_bus_payload)
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.rate_limited_log import RateLimitedLog
from services.mesh.settings_signing import REFUSAL_LOG_INTERVAL_S, DocumentSeal, UnverifiedDocument
from services.router.auth import KeyStore, read_keys_file

log = structlog.get_logger(__name__)

SETTINGS_FILE_ENV = "WEFT_SETTINGS_FILE"
NATS_URL_ENV = "WEFT_NATS_URL"
REPUBLISH_ENV = "WEFT_SETTINGS_REPUBLISH_S"
# A follower that connects asks for the document (live_settings.WANT_KIND); asks are answered
# by one publish at most this often, so a flood of them (any executor's or scheduler's
# credentials may send one) costs a few publishes a second, and a burst of services starting
# together is answered by one.
ANSWER_GAP_S = 0.25
PUBLISH_ON_STOP_S = 2.0  # how long ``stop`` lets a change's publish in flight finish


class VersionConflict(Exception):
    """A change was made against a version that is no longer current (HTTP 409)."""


class CatchingUp(Exception):
    """The router has not heard the other routers' document yet (HTTP 503, retry)."""


@dataclass(frozen=True)
class LiveOptions:
    settings_file: str = ""
    nats_url: str = ""
    republish_s: float = 2.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LiveOptions:
        env = os.environ if environ is None else environ
        try:
            republish_s = float(env.get(REPUBLISH_ENV, "2.0"))
        except ValueError:
            raise ValueError(f"{REPUBLISH_ENV} must be a number of seconds") from None
        if not 0 < republish_s < 3600:
            raise ValueError(f"{REPUBLISH_ENV} must be in (0, 3600), got {republish_s}")
        return cls(env.get(SETTINGS_FILE_ENV, ""), env.get(NATS_URL_ENV, ""), republish_s)

    @property
    def listen_s(self) -> float:
        """How long a starting router listens for other routers' documents before it claims its own."""
        return 1.5 * self.republish_s


def default_writer() -> str:
    """This router process's writer id: host (the pod's name in Kubernetes), pid, a random tail."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def bus_source(writer: str) -> str:
    """A router's bus name from its writer id: ``router-`` and the id, at most 128
    characters a NATS subject token can hold (subjects.py). An id that had to be changed to
    fit (a dot, a non-ASCII letter, too long) ends in 12 hex digits of its SHA-256, so two
    ids never share a name ("east.1" and "east-1" would both read "router-east-1")."""
    name = "router-" + writer
    if re.fullmatch(r"[A-Za-z0-9_-]{1,128}", name):
        return name
    digest = hashlib.sha256(writer.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', name)[:115]}-{digest}"


def read_settings_file(path: str) -> LiveDocument:
    """The document in ``path`` (no keys: those live in the keys file); SettingsError naming the field."""
    if not path:
        return LiveDocument()
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SettingsError("(settings file)", f"cannot read {path}: {exc}") from None
    if isinstance(value, dict) and "keys" in value:
        raise SettingsError("keys", f"{path}: API keys belong in the keys file (--keys-file)")
    return LiveDocument.parse(value)


class RouterLiveSettings:
    """Holds the current document; every change goes through ``_commit`` (validated
    already, swapped in one assignment, then published)."""

    def __init__(self, keys: KeyStore, keys_file: str, options: LiveOptions, writer: str = "",
                 clock: Callable[[], float] = time.time, security: MeshSecurity | None = None) -> None:
        """``writer``: this router's id (default ``default_writer()``); ``clock``: unix seconds;
        ``security``: whose mesh secret signs what this router sends and must sign what it
        adopts (default: this process's, ``mesh_auth.current()``; none: nothing signed)."""
        self.keys = keys
        self.keys_file = keys_file
        self.options = options
        self.writer = writer or default_writer()
        # this router's name on the bus: its own subjects (weft.settings.<source>), so the
        # inboxes keep one slot per router and the signature binds a document to them
        self.source = bus_source(self.writer)
        self._clock = clock
        # signs what this router publishes, opens what it hears (settings_signing.py)
        self.seal = DocumentSeal((security if security is not None else mesh_auth.current()).secret, "router")
        self._log_malformed = RateLimitedLog("live_settings_peer_refused", REFUSAL_LOG_INTERVAL_S, logger=log)
        base = read_settings_file(options.settings_file)
        self.document = LiveDocument(max(base.version, 1), keys.entries, base.sections, 0.0, self.writer, "files")
        self.listening = True  # until ``claim``: adopt only other routers' changes, not their files
        self.caught_up = asyncio.Event()  # set by ``claim``: admin changes wait for it
        if not options.nats_url:
            self.caught_up.set()  # no bus: no other router to hear
        self.bus = None
        self._republish: asyncio.Task | None = None
        self._answer: asyncio.Task | None = None  # the publish that answers the asks heard so far
        self._answered_at = -math.inf  # monotonic seconds of the last answer's publish
        self.num_answers = 0
        self._stopping = False  # set by ``stop``: no new answer or change publish
        self._publishing: set[asyncio.Task] = set()  # a change's publishes in flight (``_commit``)
        SETTINGS_VERSION.labels("router").set(self.document.version)

    # -- changes ------------------------------------------------------------------------
    def patch(self, patch: object, expected_version: int | None = None) -> LiveDocument:
        """Apply a JSON merge patch. Raises SettingsError (bad value, nothing changed) or
        VersionConflict (``expected_version`` is not the current one)."""
        current = self.document
        if isinstance(patch, dict) and "version" in patch:
            given = patch["version"]
            if type(given) is not int or given != current.version:  # true and 1.0 equal 1 in Python
                raise VersionConflict(f"the patch is against version {given}, the current one is {current.version}")
            patch = {k: v for k, v in patch.items() if k != "version"}
        if expected_version is not None and expected_version != current.version:
            raise VersionConflict(f"If-Match names version {expected_version}, the current one is {current.version}")
        new = current.merged(patch)
        _check_keys_kept(current, new, by_admin_api=True)
        if new.same_settings(current):
            return current
        new = new.stamped(current.version + 1, self._now(), self.writer, "admin_api")
        self._persist(current, new)
        return self._commit(new, "admin_api")

    async def patch_when_caught_up(self, patch: object, expected_version: int | None = None) -> LiveDocument:
        """``patch`` once this router has heard the others (its listen window at start):
        made earlier, it would merge onto this router's own files, be stamped newest and
        revert a change made meanwhile on another replica. Raises CatchingUp when that
        takes longer than two listen windows (e.g. NATS unreachable since the start)."""
        if not self.caught_up.is_set():
            try:
                await asyncio.wait_for(self.caught_up.wait(), 2 * self.options.listen_s)
            except asyncio.TimeoutError:
                raise CatchingUp("this router has not heard the other routers' settings yet (NATS unreachable "
                                 "since it started?); retry, or send the change to another router") from None
        return self.patch(patch, expected_version)

    def reload(self) -> LiveDocument:
        """Re-read the keys file and the settings file (SIGHUP); a bad file changes nothing.
        What has no file (keys, or settings: Kubernetes configures no settings file) keeps
        what runs, a PATCH included: a SIGHUP for a new keys Secret reverts no setting."""
        base = read_settings_file(self.options.settings_file)
        keys = read_keys_file(self.keys_file) if self.keys_file else dict(self.document.keys)
        current = self.document
        sections = base.sections if self.options.settings_file else current.sections
        new = LiveDocument(current.version, keys, sections)
        _check_keys_kept(current, new, by_admin_api=False)
        if new.same_settings(current) and base.version <= current.version:
            return current
        return self._commit(new.stamped(max(current.version + 1, base.version), self._now(), self.writer, "reload"),
                            "reload")

    def adopt(self, data: bytes) -> LiveDocument:
        """Another router's whole document (weft.routersettings): adopted, keys included,
        when it is newer than ours; ours kept otherwise, or when it would open this router
        (no keys while it runs with keys). Raises SettingsError when malformed, and
        UnverifiedDocument (logged already) when a mesh secret is set and the document is
        not signed with it: another mesh's router, or a forger, never hands us keys."""
        new = decode_bus_payload(data, self.seal, ROUTER_BUS_KIND)
        current = self.document
        if new.writer == self.writer or new.stamp <= current.stamp:
            return current  # our own echo, or older than what we hold
        if self.listening and new.origin == "files":
            return current  # another router's files are no newer than ours: we claim ours
        if new.origin == "files" and current.origin != "files":
            # A router claimed its files without hearing our change (it was in flight as that
            # router's listen window closed): files never replace a change made while running,
            # so the change is stamped again, after that claim, and everyone adopts it.
            return self._commit(current.stamped(current.version, self._now(after=new.updated_at), self.writer,
                                                current.origin), "reasserted")
        _check_keys_kept(current, new, by_admin_api=False)
        return self._commit(new, "adopted", publish=False)

    def claim(self) -> LiveDocument:
        """After listening at start: our own document, still unreplaced, is stamped now."""
        self.listening = False
        self.caught_up.set()
        current = self.document
        if current.writer != self.writer:
            return current  # adopted another router's change
        return self._commit(current.stamped(current.version, self._now(), self.writer, current.origin), "claimed",
                            publish=False)

    def _now(self, after: float = 0.0) -> float:
        """Now, and always after the document held and ``after`` (another router's clock may run ahead)."""
        return max(self._clock(), math.nextafter(max(self.document.updated_at, after), math.inf))

    def _commit(self, new: LiveDocument, cause: str, publish: bool = True) -> LiveDocument:
        self.keys.replace(new.keys)  # validated already: cannot raise
        self.document = new
        SETTINGS_VERSION.labels("router").set(new.version)
        log.info("live_settings_changed", version=new.version, cause=cause, num_keys=len(new.keys),
                 writer=new.writer, updated_at=new.updated_at,
                 overrides={n: dict(v) for n, v in new.sections.items()})
        if self.bus is not None and publish and not self._stopping:
            # held until done: the loop keeps only a weak reference to a task
            task = asyncio.get_running_loop().create_task(self.publish(), name="settings-publish")
            self._publishing.add(task)
            task.add_done_callback(self._publishing.discard)
        return new

    def _persist(self, old: LiveDocument, new: LiveDocument) -> None:
        """Write what changed to its file, so SIGHUP and restarts keep it. A file that
        cannot be written (Kubernetes mounts the keys Secret read-only) does not refuse
        the change: it runs, shared with the other routers, until every router restarts,
        as with no file configured; the failure is logged."""
        writes = []
        if self.keys_file and dict(new.keys) != dict(old.keys):
            writes.append((self.keys_file, {k: {"tenant": e.tenant, "role": e.role} for k, e in new.keys.items()}))
        if self.options.settings_file:
            writes.append((self.options.settings_file, {k: v for k, v in new.to_json().items() if k != "keys"}))
        for path, body in writes:
            try:
                _write_atomically(path, body)
            except OSError as exc:
                log.error("live_settings_not_persisted", file=path, error=str(exc), version=new.version,
                          detail="the change runs until every router restarts; edit the file (or its Secret) to keep it")

    # -- the bus ------------------------------------------------------------------------
    def sealed(self, kind: str, doc: LiveDocument | None = None) -> bytes:
        """``doc`` (default: the current one) as published on ``weft.<kind>`` (BUS_KIND: no
        keys; ROUTER_BUS_KIND: keys included), signed when this router has a mesh secret."""
        doc = doc if doc is not None else self.document
        return self.seal.seal(kind, doc.router_document() if kind == ROUTER_BUS_KIND else doc.bus_document(),
                              self.source)

    async def publish(self) -> None:
        if self.bus is not None:
            doc = self.document  # one document on both subjects, whatever changes while sending
            await self.bus.publish_document(BUS_KIND, self.sealed(BUS_KIND, doc))
            await self.bus.publish_document(ROUTER_BUS_KIND, self.sealed(ROUTER_BUS_KIND, doc))

    async def _on_router_document(self, data: bytes) -> bool:
        """True for a genuine document (the inbox lets its subject through a junk flood)."""
        try:
            self.adopt(data)
        except UnverifiedDocument:
            return False  # logged (rate-limited) and counted by the seal; we keep our own
        except SettingsError as exc:
            self._log_malformed("malformed", error=str(exc), running_version=self.document.version)
            return False
        return True

    async def _on_want(self, _data: bytes) -> bool:
        """A follower has just connected and asks for the document (``WANT_KIND``). The
        body is ignored, so the ask is always "genuine" to the inbox."""
        self.publish_soon()
        return True

    def publish_soon(self) -> None:
        """Publish the document soon: for a follower's ask, and when this router's own NATS
        link comes back (a change made meanwhile reached nobody; a follower that came back
        first asked into the void). One publish answers everything asked before it starts,
        and such publishes are ``ANSWER_GAP_S`` apart. While listening at start nothing is
        sent: the claim publishes."""
        if self.listening or self._answer is not None or self.bus is None or self._stopping:
            return  # the claim, or an answer not yet sent, covers this (or nothing is sent any more)
        delay = max(0.0, self._answered_at + ANSWER_GAP_S - time.monotonic())
        self._answer = asyncio.get_running_loop().create_task(self._answer_after(delay), name="settings-answer")

    async def _answer_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._answer = None  # from here on, an ask is heard after this publish started: it gets its own
        self._answered_at = time.monotonic()
        self.num_answers += 1
        await self.publish()

    async def start(self) -> None:
        """Connect the bus (when configured), republish forever, answer followers' asks, reload on SIGHUP."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        if not self.options.nats_url:
            log.info("live_settings_local_only", reason=f"{NATS_URL_ENV} not set: the document stays in this router")
            self.claim()  # no other router to hear
            return
        from services.mesh.nats_bus import EventBus

        self.bus = EventBus(self.options.nats_url, self.source)
        await self.bus.start()
        await self.bus.require_login()
        await self.bus.subscribe_documents(ROUTER_BUS_KIND, self._on_router_document,
                                           screen=functools.partial(self.seal.admits, ROUTER_BUS_KIND),
                                           order=self.seal.sent_at)
        await self.bus.subscribe_documents(WANT_KIND, self._on_want)
        self.bus.on_connect(self.publish_soon)
        self._republish = asyncio.create_task(self._republish_forever(), name="settings-republish")

    async def stop(self) -> None:
        """Stop publishing, then close the bus. A change's publish already in flight may
        finish (``PUBLISH_ON_STOP_S``); asks still waiting in the inbox are handed over
        while the bus closes: ``_stopping`` keeps them from starting an answer that would
        outlive this call."""
        self._stopping = True
        if self._publishing:  # a change made just before: let it reach the others (a publish is one write)
            await asyncio.wait(set(self._publishing), timeout=PUBLISH_ON_STOP_S)
        for task in (self._republish, self._answer, *self._publishing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._answer = None
        if self.bus is not None:
            await self.bus.close()

    async def _republish_forever(self) -> None:
        # Listen once connected: a router that starts while NATS is unreachable hears no
        # other router, and its files, claimed as the newest document, would replace the
        # change the running routers hold as soon as NATS is back.
        while not await self.bus.wait_connected(self.options.republish_s):
            pass
        await asyncio.sleep(self.options.listen_s)  # another router's newer document is adopted meanwhile
        self.claim()
        while True:
            await self.publish()
            await asyncio.sleep(self.options.republish_s)

    def _on_sighup(self) -> None:
        try:
            doc = self.reload()
        except (OSError, ValueError) as exc:
            log.error("live_settings_reload_refused", error=str(exc), running_version=self.document.version)
            return
        log.info("live_settings_reloaded", version=doc.version)


def _check_keys_kept(current: LiveDocument, new: LiveDocument, *, by_admin_api: bool) -> None:
    """Refuse a change that would open a router running with keys (an empty keys table
    makes every caller the ``default`` tenant: a ``{"keys": null}`` patch, or a SIGHUP
    while the keys file is empty or half written), or, through the admin API, remove its
    last admin key (nobody could call the API again to undo it). Raises SettingsError."""
    if current.keys and not new.keys:
        raise SettingsError("keys", "would remove every API key and open this router to anyone "
                                    "(the default tenant); a running router cannot drop authentication: "
                                    "restart it without --keys-file to run open")
    admins = [k for k, e in new.keys.items() if e.role == "admin"]
    if by_admin_api and not admins and any(e.role == "admin" for e in current.keys.values()):
        raise SettingsError("keys", "would remove the last admin key: nobody could call the admin API again "
                                    "(edit the keys file and send SIGHUP to do that)")


def _write_atomically(path: str, value: object) -> None:
    """Replace ``path`` in one rename. The temporary copy (API keys, for the keys file) is
    created with the file's own mode (0600 for a new one), never the umask's, and removed
    when the write fails."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    mode = target.stat().st_mode & 0o777 if target.exists() else 0o600
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(fd, mode)  # before writing: a copy left by a crash kept its own mode through O_CREAT
            out.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
