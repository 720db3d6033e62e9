"""The scheduler's view of the mesh, fed by NATS events: executor membership, load and
the kv index, plus the pool of executor channels. Part of the server layer (it reads
event protos); the decisions live in membership.py, kv_index.py and placement.py.

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

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.mesh import mesh_auth, metrics
from services.mesh.grpc_server import channel_options
from services.mesh.heartbeat_signing import Verdict, signer_for
from services.mesh.mesh_auth import MeshSecurity, mesh_channel
from services.mesh.nats_bus import Delivery, EventBus
from services.mesh.rate_limited_log import RateLimitedLog
from services.scheduler.policy.degradation import Rung
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import ExecutorLoad, ExecutorRecord, ExecutorState, Membership
from weft.v1 import common_pb2, events_pb2, executor_pb2_grpc

log = structlog.get_logger(__name__)

EXECUTORS = metrics.gauge("weft_scheduler_executors", "Known executors.")
HEARTBEATS_REJECTED = metrics.counter("weft_scheduler_heartbeats_rejected_total",
                                      "Executor heartbeats dropped: unsigned, badly signed or unverified.",
                                      ["reason"])
REJECT_LOG_INTERVAL_S = 10.0
PROBE_TIMEOUT_S = 1.0  # a silent executor's health probe; a paused one times out and is dropped

Prober = Callable[[ExecutorRecord], Awaitable[bool]]

_STATES = {
    events_pb2.EXECUTOR_STATE_JOINING: ExecutorState.JOINING,
    events_pb2.EXECUTOR_STATE_SERVING: ExecutorState.SERVING,
    events_pb2.EXECUTOR_STATE_DRAINING: ExecutorState.DRAINING,
    events_pb2.EXECUTOR_STATE_FAILED: ExecutorState.FAILED,
}
_STATES_BACK = {v: k for k, v in _STATES.items()}


def rung_from_pb(value: int) -> Rung:
    """A ``DegradationRung`` enum value → Rung. UNSPECIFIED (an older sender): none; a value
    this scheduler does not know (a newer sender): shed, which no request is placed on."""
    if not value:
        return Rung.NONE
    try:
        return Rung.parse(common_pb2.DegradationRung.Name(value).removeprefix("DEGRADATION_RUNG_"))
    except ValueError:
        return Rung.SHED


def rung_to_pb(rung: Rung) -> int:
    return common_pb2.DegradationRung.Value(f"DEGRADATION_RUNG_{rung.name}")


class ChannelPool:
    """One gRPC channel per executor address, reused across requests."""

    def __init__(self, max_message_bytes: int) -> None:
        self._options = channel_options(max_message_bytes)
        self._stubs: dict[str, tuple[grpc.aio.Channel, executor_pb2_grpc.ExecutorStub]] = {}

    async def serving(self, rec: ExecutorRecord) -> bool:
        """Whether ``rec`` answers grpc.health.v1 SERVING at its (verified) address, over
        the pooled channel. Never raises."""
        self.stub(rec.address)
        channel = self._stubs[rec.address][0]
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stub(self, address: str) -> executor_pb2_grpc.ExecutorStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = mesh_channel(address, options=self._options)
            entry = (channel, executor_pb2_grpc.ExecutorStub(channel))
            self._stubs[address] = entry
        return entry[1]

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


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
        rec = ExecutorRecord(
            name=msg.name, address=msg.address, model_id=msg.model_id, block_size=msg.block_size,
            state=_STATES.get(msg.state, ExecutorState.JOINING), max_num_seqs=msg.max_num_seqs,
            num_blocks=msg.num_blocks, max_model_len=msg.max_model_len,
            interval_s=(msg.interval_ms or 1000) / 1000.0, heartbeat_sequence=msg.header.sequence,
            serves_rung=rung_from_pb(msg.serves_rung), kv_cache_dtype=msg.kv_cache_dtype or "auto",
            verified=self._signer is not None,
        )
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
        self.membership.update_load(msg.header.source, ExecutorLoad(
            num_running=msg.num_running, num_waiting=msg.num_waiting,
            num_free_blocks=msg.num_free_blocks, num_blocks=msg.num_blocks,
        ))

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
