"""The scheduler's view of the mesh, fed by NATS events: executor membership, load and
the kv index. Part of the api layer (it reads event protos, converted by convert.py); the
decisions live in state/membership.py, state/kv_index.py and policy/placement.py.

Heartbeats decide where prompts and the mesh secret go, so with a mesh secret only signed
ones count (services/mesh/heartbeat_signing.py): an unsigned or badly signed heartbeat is
dropped before its sequence is tracked, logged ``heartbeat_rejected`` (at most once per
``REJECT_LOG_INTERVAL_S`` per reason, with the number held back) and counted. Every
executor the scheduler knows then came from a verified heartbeat, and so does every
address it calls with the secret. Without a secret (development) heartbeats are taken
unverified and ``heartbeats_unverified`` is logged once."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from services.mesh import mesh_auth, metrics
from services.mesh.heartbeat_signing import Verdict, signer_for
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.nats_bus import Delivery, EventBus
from services.mesh.rate_limited_log import RateLimitedLog
from services.scheduler.api.convert import executor_load, executor_record
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import ExecutorRecord, Membership
from weft.v1 import events_pb2

log = structlog.get_logger(__name__)

EXECUTORS = metrics.gauge("weft_scheduler_executors", "Known executors.")
HEARTBEATS_REJECTED = metrics.counter("weft_scheduler_heartbeats_rejected_total",
                                      "Executor heartbeats dropped: unsigned, badly signed or unverified.",
                                      ["reason"])
REJECT_LOG_INTERVAL_S = 10.0

Prober = Callable[[ExecutorRecord], Awaitable[bool]]


class MeshView:
    """Membership + kv index fed by NATS events (heartbeat, load, kv)."""

    def __init__(self, membership: Membership, kv_index: KvIndex, security: MeshSecurity | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``security``: whose mesh secret heartbeats must be signed with (default: this
        process's, ``mesh_auth.current()``; no secret: unverified development mode)."""
        self.membership = membership
        self.kv_index = kv_index
        self._signer = signer_for(security if security is not None else mesh_auth.current())
        self._log_rejection = RateLimitedLog("heartbeat_rejected", REJECT_LOG_INTERVAL_S, clock, log)
        self._warned_unverified = False
        self._vouched: set[str] = set()  # kept by a probe during a bus silence (logged once)
        membership.on_removed(self._forget)

    async def subscribe(self, bus: EventBus) -> None:
        await bus.subscribe("heartbeat", events_pb2.ExecutorHeartbeat, self.on_heartbeat,
                            accept=self.accept_heartbeat)
        await bus.subscribe("load", events_pb2.LoadReport, self.on_load)
        await bus.subscribe("kv", events_pb2.KvEvent, self.on_kv)

    def accept_heartbeat(self, msg: events_pb2.ExecutorHeartbeat) -> bool:
        """Whether ``msg`` may count: with a secret, only with a valid signature (else
        logged, rate-limited, and counted). Does not modify the view."""
        if self._signer is None:
            if not self._warned_unverified:
                self._warned_unverified = True
                log.warning("heartbeats_unverified", detail="no mesh secret: any NATS client that may publish "
                            "heartbeats can announce any executor; set WEFT_MESH_SECRET")
            return True
        verdict = self._signer.verify(msg)
        if verdict is not Verdict.VALID:
            self._reject(msg, verdict.value)
        return verdict.ok

    def _reject(self, msg: events_pb2.ExecutorHeartbeat, reason: str) -> None:
        HEARTBEATS_REJECTED.labels(reason).inc()
        self._log_rejection(reason, executor=msg.name[:64], address=msg.address[:128], source=msg.header.source[:64])

    def on_heartbeat(self, msg: events_pb2.ExecutorHeartbeat, delivery: Delivery) -> None:
        if not self.accept_heartbeat(msg):  # the bus filters already; direct callers too
            return
        rec = executor_record(msg, verified=self._signer is not None)
        if not self.membership.admits(rec):
            self._reject(msg, "unverified_change")
            return
        if delivery is Delivery.RESTARTED:
            self.kv_index.drop_source(msg.name)
        prev = self.membership.get(rec.name)
        self._vouched.discard(rec.name)
        if self.membership.heartbeat(rec):
            log.info("executor_joined", executor=rec.name, address=rec.address, model_id=rec.model_id,
                     state=rec.state.value, serves_rung=rec.serves_rung.label)
        elif prev is not None and prev.state is not rec.state:
            log.info("executor_state_changed", executor=rec.name, state=rec.state.value)
        EXECUTORS.set(len(self.membership))

    def on_load(self, msg: events_pb2.LoadReport, delivery: Delivery) -> None:
        self.membership.update_load(msg.header.source, executor_load(msg))

    def on_kv(self, msg: events_pb2.KvEvent, delivery: Delivery) -> None:
        if msg.tier not in (events_pb2.TIER_ACTIVE, events_pb2.TIER_UNSPECIFIED):
            # Cachestore tiers make no executor a prefix holder, but any executor can
            # load those blocks: the index keeps them apart (kv_index.py).
            source, tier = msg.header.source, events_pb2.Tier.Name(msg.tier)
            if delivery.needs_resync or msg.kind == events_pb2.KV_EVENT_KIND_CLEARED:
                self.kv_index.drop_store(source)
            if msg.kind == events_pb2.KV_EVENT_KIND_STORED:
                self.kv_index.store_stored(source, tier, msg.block_hashes)
            elif msg.kind == events_pb2.KV_EVENT_KIND_REMOVED:
                self.kv_index.store_removed(source, tier, msg.block_hashes)
            return
        source = msg.header.source
        if delivery.needs_resync:
            dropped = self.kv_index.drop_source(source)
            log.info("kv_index_resync", executor=source, reason=delivery.value, num_dropped=dropped)
        if msg.kind == events_pb2.KV_EVENT_KIND_STORED:
            self.kv_index.stored(source, msg.block_hashes)
        elif msg.kind == events_pb2.KV_EVENT_KIND_REMOVED:
            self.kv_index.removed(source, msg.block_hashes)
        elif msg.kind == events_pb2.KV_EVENT_KIND_CLEARED:
            self.kv_index.drop_source(source)

    def _forget(self, rec: ExecutorRecord) -> None:
        self.kv_index.drop_source(rec.name)
        EXECUTORS.set(len(self.membership))
        log.info("executor_removed", executor=rec.name, address=rec.address)

    async def expire_forever(self, bus: EventBus, probe: Prober | None = None, period_s: float = 0.2) -> None:
        """Expire silent executors, but only while our own bus is connected: with NATS
        down every executor falls silent, and dropping them all would stop serving.
        (A dead executor is then found by its failed call and skipped.)

        A connected bus is not a working one: a frozen NATS (SIGSTOP, a partition that
        keeps the TCP connection open) silences every heartbeat while ``bus.connected``
        stays true. So a silent executor is first asked directly (``probe``: its gRPC
        health at its verified address); one that answers SERVING stays, and only one
        that does not is dropped."""
        was_connected = bus.connected
        while True:
            connected = bus.connected
            if connected and not was_connected:
                self.membership.refresh_all()
            elif connected:
                await self.expire_silent(probe)
            was_connected = connected
            await asyncio.sleep(period_s)

    async def expire_silent(self, probe: Prober | None) -> list[ExecutorRecord]:
        """Drop the silent executors that do not answer ``probe`` (all of them without
        one); returns the dropped. Vouched-for ones are logged once per silence."""
        silent = self.membership.silent()
        if probe is None or not silent:
            return self.membership.expire()
        answers = await asyncio.gather(*(probe(rec) for rec in silent), return_exceptions=True)
        dropped = []
        for rec, answer in zip(silent, answers):
            if answer is True:
                if self.membership.vouch(rec) and rec.name not in self._vouched:
                    self._vouched.add(rec.name)
                    log.warning("executor_silent_but_serving", executor=rec.name, address=rec.address,
                                detail="no heartbeat over NATS, but it answers its health probe: kept")
            elif self.membership.remove_if_unchanged(rec):
                dropped.append(rec)
        return dropped
