"""Host RAM over disk: one store, two tiers, a small policy hook.

Mechanism here, policy in a ``TierPolicy`` object (enum + factory, so an ablation is a
flag). The richer demotion policy (pause length, pressure, age) comes with the agent
issue; today's policies only decide where a new block lands and what happens to a
block the host tier evicts.

Thread-safety: every method takes one lock, so the gRPC server may call them from
worker threads (disk I/O never blocks the event loop).
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from services.cachestore.blocks import Block
from services.cachestore.disk_tier import DiskTier
from services.cachestore.host_tier import HostTier


class Tier(enum.Enum):
    SLEEPING = "sleeping"  # host RAM
    ARCHIVED = "archived"  # disk


class TierPolicyName(enum.Enum):
    DEMOTE_ON_EVICT = "demote_on_evict"  # new blocks to RAM; RAM evictions go to disk
    WRITE_THROUGH = "write_through"  # new blocks to RAM and disk
    HOST_ONLY = "host_only"  # never touch disk


@dataclass(frozen=True)
class TierPolicy:
    write_to_disk_on_put: bool
    demote_on_host_evict: bool
    promote_on_disk_hit: bool


def make_tier_policy(name: TierPolicyName) -> TierPolicy:
    if name is TierPolicyName.DEMOTE_ON_EVICT:
        return TierPolicy(write_to_disk_on_put=False, demote_on_host_evict=True, promote_on_disk_hit=True)
    if name is TierPolicyName.WRITE_THROUGH:
        return TierPolicy(write_to_disk_on_put=True, demote_on_host_evict=False, promote_on_disk_hit=True)
    if name is TierPolicyName.HOST_ONLY:
        return TierPolicy(write_to_disk_on_put=False, demote_on_host_evict=False, promote_on_disk_hit=False)
    raise ValueError(f"unknown tier policy {name!r}")


@dataclass(frozen=True)
class PutResult:
    stored: bool  # False: too large for every tier
    already_present: bool


class TieredStore:
    def __init__(self, host: HostTier, disk: DiskTier | None, policy: TierPolicy) -> None:
        self.host = host
        self.disk = disk
        self.policy = policy
        self._lock = threading.Lock()

    def put(self, block: Block) -> PutResult:
        with self._lock:
            if self._tier_of(block.block_hash) is not None:
                return PutResult(stored=True, already_present=True)
            stored = False
            evicted = self.host.put(block)
            if evicted is not None:
                stored = True
                if self.policy.demote_on_host_evict and self.disk is not None:
                    for old in evicted:
                        self.disk.put(old)
            if self.disk is not None and (self.policy.write_to_disk_on_put or evicted is None):
                stored = self.disk.put(block) is not None or stored
            return PutResult(stored=stored, already_present=False)

    def get(self, block_hash: int) -> Block | None:
        with self._lock:
            block = self.host.get(block_hash)
            if block is not None or self.disk is None:
                return block
            block = self.disk.get(block_hash)
            if block is not None and self.policy.promote_on_disk_hit and self.host.can_hold(block.size_bytes):
                evicted = self.host.put(block) or []
                if self.policy.demote_on_host_evict:
                    for old in evicted:
                        self.disk.put(old)
            return block

    def tier_of(self, block_hash: int) -> Tier | None:
        """Highest tier holding the block; does not touch recency."""
        with self._lock:
            return self._tier_of(block_hash)

    def _tier_of(self, block_hash: int) -> Tier | None:
        if self.host.contains(block_hash):
            return Tier.SLEEPING
        if self.disk is not None and self.disk.contains(block_hash):
            return Tier.ARCHIVED
        return None
