"""Process wiring of a cachestore: config → tiers → gRPC server → drain."""
from __future__ import annotations

import sys
from collections.abc import Sequence

import structlog

from services.cachestore.config import DESCRIPTION, CacheStoreConfig
from services.cachestore.disk_tier import DiskTier
from services.cachestore.errors import ERROR_RULES
from services.cachestore.host_tier import HostTier
from services.cachestore.server import CacheStoreServicer
from services.cachestore.tiers import TieredStore, make_tier_policy
from services.mesh.env_config import load_config
from services.mesh.grpc_server import GrpcServer
from services.mesh.logging import configure_logging
from services.mesh.metrics import MetricsServer
from weft.v1 import cachestore_pb2_grpc

log = structlog.get_logger(__name__)


async def main(argv: Sequence[str] | None = None) -> None:
    config = load_config(CacheStoreConfig, "cachestore", DESCRIPTION, sys.argv[1:] if argv is None else argv)
    configure_logging("cachestore", config.log_level, config.log_format)
    disk = DiskTier(config.disk_dir, config.disk_capacity_bytes, config.disk_fsync) if config.disk_dir else None
    store = TieredStore(HostTier(config.host_capacity_bytes), disk, make_tier_policy(config.tier_policy_name))
    grpc_server = GrpcServer("weft.v1.CacheStore", config.host, config.port, rules=ERROR_RULES,
                             max_message_bytes=config.max_message_bytes, grace_s=config.grace_s)
    cachestore_pb2_grpc.add_CacheStoreServicer_to_server(
        CacheStoreServicer(store, config.max_block_bytes, config.chunk_bytes), grpc_server.server)
    metrics_server = MetricsServer(config.host, config.metrics_port)
    await metrics_server.start()
    port = await grpc_server.start()
    log.info("cachestore_ready", port=port, disk_dir=config.disk_dir or None, tier_policy=config.tier_policy)
    try:
        await grpc_server.serve_until_signal()
    finally:
        await metrics_server.stop()
        log.info("cachestore_stopped")
