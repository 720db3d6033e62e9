"""Host RAM over disk: one store, two tiers, policies deciding what moves where.

Mechanism here, policy in two objects (each an enum + factory, so an ablation is a
flag): a ``TierPolicy`` decides where a new block lands and what happens to a block
RAM evicts or disk serves; a ``DemotionPolicy`` (``demotion.py``) picks sleeping blocks
to archive on each ``sweep`` (pause length, pressure, age, priority). ``archive`` moves
named blocks down at once (KV a session released: the scheduler's intent shift).

Every change of a tier's contents is queued as a ``TierChange`` (``take_changes``), so
the kv events the cachestore publishes mirror exactly which hashes each tier holds; a
block may sit in both tiers at once (a disk block read back is copied up to RAM).

A failed disk write (full disk, I/O error) never escapes: the block simply is not on
disk (a later miss), the failure is counted and logged.

Thread-safety: every method takes one lock, so the gRPC server may call them from
worker threads (disk I/O never blocks the event loop).
"""
from __future__ import annotations

import enum
import errno
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from services.cachestore.blocks import Block
from services.cachestore.disk_demotion import DemotionPolicy, NeverDemote, SleepingBlock
from services.cachestore.disk_tier import DiskTier
from services.cachestore.host_tier import HostTier
from services.mesh.rate_limited_log import RateLimitedLog

log = structlog.get_logger(__name__)
DISK_ERROR_LOG_INTERVAL_S = 10.0  # a full disk fails every block write: one line per errno per interval


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
    stored: bool  # False: too large for every tier (or the disk refused it)
    already_present: bool


@dataclass(frozen=True)
class TierChange:
    """Hashes that entered (``stored``) or left a tier, in order."""

    tier: Tier
    stored: bool
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class ArchiveResult:
    """What ``archive`` did with the hashes it was given (each counted once)."""

    num_archived: int  # moved RAM -> disk now
    num_already_archived: int  # on disk and not in RAM
    num_missing: int  # in neither tier
    num_kept: int  # left in RAM: no disk tier, or the write failed


@dataclass
class TierCounters:
    """Movements between tiers since start (read by metrics and benchmarks)."""

    num_demoted_to_disk: int = 0  # RAM → disk (sweep or RAM eviction)
    num_promoted_to_host: int = 0  # disk → RAM on a read
    num_disk_write_errors: int = 0
    num_dropped: int = 0  # left the store entirely


class TieredStore:
    def __init__(self, host: HostTier, disk: DiskTier | None, policy: TierPolicy,
                 demotion: DemotionPolicy | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.disk = disk
        self.policy = policy
        self.demotion = demotion or NeverDemote()
        self.clock = clock
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._stored_at: dict[int, float] = {}  # host blocks: first stored
        self._used_at: dict[int, float] = {}  # host blocks: last stored or read
        self._changes: list[TierChange] = []
        self.layouts: set[tuple[str, int]] = set()  # (model id, block size) of stored blocks: for prefetch hashing
        self._log_disk_error = RateLimitedLog("disk_write_failed", DISK_ERROR_LOG_INTERVAL_S, clock, log)

    # -- bookkeeping ----------------------------------------------------------
    def _note(self, tier: Tier, stored: bool, hashes) -> None:
        hashes = tuple(hashes)
        if hashes:
            self._changes.append(TierChange(tier, stored, hashes))

    def take_changes(self) -> list[TierChange]:
        """Drain the queued tier changes (oldest first)."""
        with self._lock:
            changes, self._changes = self._changes, []
            return changes

    def _host_put(self, block: Block) -> list[Block] | None:
        evicted = self.host.put(block)
        if evicted is None:
            return None
        now = self.clock()
        self._stored_at.setdefault(block.block_hash, now)
        self._used_at[block.block_hash] = now
        self._note(Tier.SLEEPING, True, [block.block_hash])
        for old in evicted:
            self._forget_host(old.block_hash)
        self._note(Tier.SLEEPING, False, [b.block_hash for b in evicted])
        return evicted

    def _forget_host(self, block_hash: int) -> None:
        self._stored_at.pop(block_hash, None)
        self._used_at.pop(block_hash, None)

    def _disk_put(self, block: Block) -> bool:
        """Write to disk; False (logged, counted) when it does not fit or the write fails."""
        if self.disk is None:
            return False
        try:
            evicted = self.disk.put(block)
        except OSError as exc:  # ENOSPC, EIO, ...: a miss later, never a crash
            self.counters.num_disk_write_errors += 1
            # Reason = the errno's name: ENOSPC floods are one line per interval with a count.
            self._log_disk_error(errno.errorcode.get(exc.errno, type(exc).__name__), block_hash=block.block_hash,
                                 error=str(exc), num_disk_write_errors=self.counters.num_disk_write_errors)
            return False
        if evicted is None:
            return False
        self._note(Tier.ARCHIVED, False, evicted)
        self._note(Tier.ARCHIVED, True, [block.block_hash])
        return True

    def _demote(self, blocks: list[Block]) -> None:
        for old in blocks:
            if self.disk is not None and self.disk.contains(old.block_hash):
                continue
            if self._disk_put(old):
                self.counters.num_demoted_to_disk += 1
            else:
                self.counters.num_dropped += 1

    # -- operations -----------------------------------------------------------
    def put(self, block: Block) -> PutResult:
        with self._lock:
            if block.meta.block_size:
                self.layouts.add((block.meta.model_id, block.meta.block_size))
            if self._tier_of(block.block_hash) is not None:
                return PutResult(stored=True, already_present=True)
            stored = False
            evicted = self._host_put(block)
            if evicted is not None:
                stored = True
                if self.policy.demote_on_host_evict:
                    self._demote(evicted)
                else:
                    self.counters.num_dropped += sum(
                        1 for b in evicted if self.disk is None or not self.disk.contains(b.block_hash))
            if self.disk is not None and (self.policy.write_to_disk_on_put or evicted is None):
                stored = self._disk_put(block) or stored
            return PutResult(stored=stored, already_present=False)

    def get(self, block_hash: int) -> Block | None:
        """The block from the highest tier holding it; a disk hit is copied up to RAM
        when the policy says so. A corrupt disk block is a miss (and is deleted)."""
        with self._lock:
            block = self.host.get(block_hash)
            if block is not None:
                self._used_at[block_hash] = self.clock()
                return block
            if self.disk is None:
                return None
            was_on_disk = self.disk.contains(block_hash)
            block = self.disk.get(block_hash)
            if block is None:
                if was_on_disk:  # corrupt: the disk tier deleted it
                    self._note(Tier.ARCHIVED, False, [block_hash])
                return None
            if self.policy.promote_on_disk_hit and self.host.can_hold(block.size_bytes):
                evicted = self._host_put(block) or []
                self.counters.num_promoted_to_host += 1
                if self.policy.demote_on_host_evict:
                    self._demote(evicted)
            return block

    def sweep(self) -> list[int]:
        """Ask the demotion policy which sleeping blocks to archive and move them to disk
        (dropping them from RAM). Returns the demoted hashes. With no disk tier, nothing
        moves: RAM is then the last tier and LRU eviction is the only way out."""
        with self._lock:
            if self.disk is None:
                return []
            now = self.clock()
            view = [
                SleepingBlock(b.block_hash, b.size_bytes, now - self._used_at.get(b.block_hash, now),
                              now - self._stored_at.get(b.block_hash, now), b.meta.priority,
                              b.meta.expected_pause_ms / 1000.0)
                for b in self.host.blocks()
            ]
            demoted = []
            for h in self.demotion.choose(view, self.host.used_bytes, self.host.capacity_bytes):
                block = self.host.remove(h)
                if block is None:
                    continue
                self._forget_host(h)
                self._note(Tier.SLEEPING, False, [h])
                if self.disk.contains(h) or self._disk_put(block):
                    self.counters.num_demoted_to_disk += 1
                    demoted.append(h)
                else:
                    self.counters.num_dropped += 1
            return demoted

    def archive(self, block_hashes) -> ArchiveResult:
        """Move the named blocks out of RAM onto disk now (released KV: reachable, but no
        longer worth RAM). A block on disk already just leaves RAM; without a disk tier, or
        when the write fails, it stays in RAM (the lowest tier then), never dropped."""
        archived = already = missing = kept = 0
        with self._lock:
            for h in dict.fromkeys(block_hashes):
                on_disk = self.disk is not None and self.disk.contains(h)
                if not self.host.contains(h):
                    already, missing = already + on_disk, missing + (not on_disk)
                    continue
                if self.disk is None:
                    kept += 1
                    continue
                block = self.host.remove(h)
                if not on_disk and not self._disk_put(block):
                    self.host.put(block)  # back where it was (it fitted): the failure is logged and counted
                    kept += 1
                    continue
                self._forget_host(h)
                self._note(Tier.SLEEPING, False, [h])
                archived += 1
                self.counters.num_demoted_to_disk += 1
        return ArchiveResult(archived, already, missing, kept)

    def warm(self, block_hashes) -> tuple[int, int]:
        """Copy the leading run of ``block_hashes`` that the store holds up to RAM
        (disk blocks are read, verified and promoted). Returns (found, warmed)."""
        found = warmed = 0
        for h in block_hashes:
            tier = self.tier_of(h)
            if tier is None:
                break
            found += 1
            if tier is Tier.ARCHIVED and self.get(h) is not None and self.tier_of(h) is Tier.SLEEPING:
                warmed += 1
        return found, warmed

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

    def resident(self) -> dict[Tier, list[int]]:
        """Every hash per tier (for a subscriber's resync). Does not modify the store."""
        with self._lock:
            out = {Tier.SLEEPING: [b.block_hash for b in self.host.blocks()]}
            if self.disk is not None:
                out[Tier.ARCHIVED] = self.disk.hashes()
            return out
