"""CacheStoreConfig: everything a cachestore process is told, from flags / WEFT_ env.

The options every service takes (host, grace, message size, metrics port, secret file,
logging) come from ``services/mesh/service_options.py``; only ``max_message_bytes`` is
redeclared, because a cachestore frames block chunks of ``chunk_bytes`` and 8 MiB is
plenty (the base allows 64 MiB).
"""
from __future__ import annotations

from dataclasses import dataclass

from services.cachestore.disk_demotion import DemotionPolicyName
from services.cachestore.semantic import DEFAULT_THRESHOLD
from services.cachestore.tiers import TierPolicyName
from services.mesh.env_config import option
from services.mesh.service_options import ServiceOptions, check_port

DESCRIPTION = (
    "Weft cachestore: a tiered KV block store (host RAM, then disk) keyed by block hash. "
    "Blocks move as chunked byte streams with an explicit header (hash, dtype, shape, "
    "size, checksum); a corrupt block on disk is a miss and is deleted."
)


@dataclass(frozen=True)
class CacheStoreConfig(ServiceOptions):
    max_message_bytes: int = option("Largest gRPC message sent or received.", default=8 << 20)
    port: int = option("gRPC port.", default=50071)
    host_capacity_bytes: int = option("Bytes of host RAM for the sleeping tier.", default=1 << 30)
    disk_dir: str = option("Directory of the archived tier; empty disables the disk tier.", default=".weft/cachestore")
    disk_capacity_bytes: int = option("Bytes of disk for the archived tier.", default=10 << 30)
    disk_fsync: bool = option("fsync each block file before its rename (durable across power loss).", default=True)
    tier_policy: str = option("Where blocks land and where RAM evictions go.", default="demote_on_evict",
                              choices=tuple(p.value for p in TierPolicyName))
    demotion_policy: str = option("Which sleeping (RAM) blocks a sweep archives to disk.", default="pause_aware",
                                  choices=tuple(p.value for p in DemotionPolicyName))
    max_idle_s: float = option("Seconds a RAM block may sit unread before a sweep archives it.", default=300.0)
    sweep_interval_s: float = option("Seconds between demotion sweeps (and kv event flushes).", default=0.5)
    nats_url: str = option("NATS server URL for kv events (tier-tagged); empty disables them.",
                           default="nats://127.0.0.1:4222", shared=True)
    name: str = option("Source name of this cachestore's kv events.", default="cachestore")
    semantic_threshold: float = option("Cosine similarity a semantic hit needs (chosen on the built-in "
                                       "paraphrase set).", default=DEFAULT_THRESHOLD)
    semantic_max_entries: int = option("Semantic entries kept per (tenant, kind, scope).", default=10_000)
    max_block_bytes: int = option("Largest block payload accepted.", default=64 << 20)
    chunk_bytes: int = option("Data chunk size of GetBlocks streams (a request may ask for less).", default=1 << 20)

    def __post_init__(self) -> None:
        super().__post_init__()  # host, grace_s, max_message_bytes, metrics_port
        check_port("port", self.port)
        for name in ("host_capacity_bytes", "disk_capacity_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_idle_s <= 0 or self.sweep_interval_s <= 0:
            raise ValueError("max_idle_s and sweep_interval_s must be > 0")
        if not -1.0 <= self.semantic_threshold <= 1.0:
            raise ValueError(f"semantic_threshold must be in [-1, 1], got {self.semantic_threshold}")
        for name in ("max_block_bytes", "chunk_bytes", "semantic_max_entries"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.chunk_bytes + 4096 > self.max_message_bytes:
            raise ValueError("chunk_bytes must leave at least 4 KiB of max_message_bytes for framing")

    @property
    def tier_policy_name(self) -> TierPolicyName:
        return TierPolicyName(self.tier_policy)

    @property
    def demotion_policy_name(self) -> DemotionPolicyName:
        return DemotionPolicyName(self.demotion_policy)
