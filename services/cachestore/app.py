"""Process wiring of a cachestore: config → tiers → gRPC server → sweeps and events → drain.

A background task runs the demotion sweep every ``sweep_interval_s`` and publishes the
tiers' changes as kv events (subject ``weft.kv.<name>``, ``tier`` = sleeping or
archived), so the scheduler's index sees the whole hierarchy. On (re)connect to NATS
the full contents of each tier are announced again (a subscriber resyncs on the new
epoch / gap anyway).

Readiness: gRPC health stays NOT_SERVING until the embedding model is loaded
(``serve_when_ready``), so ``weft up`` and probes wait for it instead of the semantic
cache missing every lookup of a fresh mesh. Tier RPCs are answered meanwhile.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence

import structlog

from services.cachestore.config import DESCRIPTION, CacheStoreConfig
from services.cachestore.disk_demotion import make_demotion_policy
from services.cachestore.disk_tier import DiskTier
from services.cachestore.errors import ERROR_RULES
from services.cachestore.host_tier import HostTier
from services.cachestore.semantic import SemanticIndex
from services.cachestore.semantic_service import SemanticService
from services.cachestore.server import DEMOTIONS, CacheStoreServicer, export_tier_gauges
from services.cachestore.tiers import Tier, TierChange, TieredStore, make_tier_policy
from services.mesh import metric_catalogue as catalogue
from services.mesh.env_config import load_config
from services.mesh.grpc_server import GrpcServer
from services.mesh.logging import configure_logging
from services.mesh.metrics import MetricsServer
from services.mesh.nats_bus import EventBus
from weft.v1 import cachestore_pb2_grpc, events_pb2

log = structlog.get_logger(__name__)

_TIER_PB = {Tier.SLEEPING: events_pb2.TIER_SLEEPING, Tier.ARCHIVED: events_pb2.TIER_ARCHIVED}


def change_to_event(change: TierChange) -> events_pb2.KvEvent:
    kind = events_pb2.KV_EVENT_KIND_STORED if change.stored else events_pb2.KV_EVENT_KIND_REMOVED
    return events_pb2.KvEvent(kind=kind, block_hashes=change.block_hashes, tier=_TIER_PB[change.tier])


def build_store(config: CacheStoreConfig) -> TieredStore:
    disk = DiskTier(config.disk_dir, config.disk_capacity_bytes, config.disk_fsync) if config.disk_dir else None
    return TieredStore(HostTier(config.host_capacity_bytes), disk, make_tier_policy(config.tier_policy_name),
                       make_demotion_policy(config.demotion_policy_name, config.max_idle_s))


async def sweep_forever(store: TieredStore, interval_s: float, bus: EventBus | None) -> None:
    while True:
        demoted = await asyncio.to_thread(store.sweep)
        if demoted:
            DEMOTIONS.labels("sleeping", "archived").inc(len(demoted))
            log.info("blocks_archived", num_blocks=len(demoted))
        changes = store.take_changes()
        if bus is not None:
            for change in changes:
                await bus.publish("kv", change_to_event(change))
        export_tier_gauges(store)
        await asyncio.sleep(interval_s)


async def serve_when_ready(grpc_server: GrpcServer, semantic: SemanticService) -> None:
    """Report NOT_SERVING, load the embedding model, then report SERVING (unless draining).
    A model that fails to load is a fatal start error (the exception propagates)."""
    await grpc_server.set_serving(False)
    await semantic.warm_up()
    if not grpc_server.draining:
        await grpc_server.set_serving(True)


async def main(argv: Sequence[str] | None = None) -> None:
    config = load_config(CacheStoreConfig, "cachestore", DESCRIPTION, sys.argv[1:] if argv is None else argv)
    configure_logging("cachestore", config.log_level, config.log_format)
    store = build_store(config)
    semantic = SemanticService(index=SemanticIndex(config.semantic_threshold, config.semantic_max_entries))
    grpc_server = GrpcServer("weft.v1.CacheStore", config.host, config.port, rules=ERROR_RULES,
                             max_message_bytes=config.max_message_bytes, grace_s=config.grace_s)
    cachestore_pb2_grpc.add_CacheStoreServicer_to_server(
        CacheStoreServicer(store, config.max_block_bytes, config.chunk_bytes, semantic), grpc_server.server)
    bus = EventBus(config.nats_url, config.name) if config.nats_url else None

    async def announce_all() -> None:
        for tier, hashes in store.resident().items():
            if hashes:
                await bus.publish("kv", change_to_event(TierChange(tier, True, tuple(hashes))))

    if bus is not None:
        bus.on_connect(announce_all)
        await bus.start()
        try:
            await bus.require_login()  # a refused login is a config error (exit 78), not an outage
        except BaseException:
            await bus.close()
            raise
    metrics_server = MetricsServer(config.host, config.metrics_port)
    catalogue.register("cachestore")
    catalogue.watch_cachestore(store)
    await metrics_server.start()
    port = await grpc_server.start()
    await grpc_server.set_serving(False)  # start() said SERVING; no request ran in between
    warm = asyncio.create_task(serve_when_ready(grpc_server, semantic), name="embedder-warm-up")
    sweeper = asyncio.create_task(sweep_forever(store, config.sweep_interval_s, bus), name="tier-sweep")
    log.info("cachestore_listening", port=port, disk_dir=config.disk_dir or None, tier_policy=config.tier_policy,
             demotion_policy=config.demotion_policy)
    try:
        stop = asyncio.create_task(grpc_server.serve_until_signal(), name="serve")
        await asyncio.wait({warm, stop}, return_when=asyncio.FIRST_COMPLETED)
        if warm.done() and warm.exception() is not None:
            stop.cancel()
            raise warm.exception()
        await stop
    finally:
        warm.cancel()
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        if bus is not None:
            await bus.close()
        await metrics_server.stop()
        log.info("cachestore_stopped")
