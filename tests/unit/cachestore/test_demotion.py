"""Demotion policies and the tiered store's movements, events and failure handling
(no model, no processes)."""
from __future__ import annotations

import errno
import os

from services.cachestore.blocks import Block, BlockMeta, checksum
from services.cachestore.disk_demotion import (
    DemotionPolicyName, PauseAwareDemotion, SleepingBlock, keep_score, make_demotion_policy,
)
from services.cachestore.disk_tier import DiskTier
from services.cachestore.host_tier import HostTier
from services.cachestore.tiers import Tier, TierChange, TieredStore, TierPolicyName, make_tier_policy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def block(h: int, size: int = 1000, priority: float = 0.0, pause_ms: int = 0) -> Block:
    payload = os.urandom(size)
    return Block(BlockMeta(h, "uint8", (size,), size, checksum(payload), "m", 16, priority, pause_ms), payload)


def store(tmp_path, host_bytes=10_000, policy=DemotionPolicyName.PAUSE_AWARE, clock=None, **kw):
    return TieredStore(HostTier(host_bytes), DiskTier(tmp_path, 1 << 20, fsync=False),
                       make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT),
                       make_demotion_policy(policy, **kw), clock=clock or Clock())


def test_pause_aware_archives_a_block_idle_past_its_expected_pause(tmp_path):
    clock = Clock()
    s = store(tmp_path, host_bytes=2500, clock=clock)  # two blocks fill RAM past the low watermark
    s.put(block(1, pause_ms=1000))  # a tool call expected to take 1 s
    s.put(block(2))  # unknown pause: only max_idle_s applies
    clock.now = 1.2
    assert s.sweep() == []  # within the 1.5x slack
    clock.now = 2.0
    assert s.sweep() == [1]
    assert s.tier_of(1) is Tier.ARCHIVED and s.tier_of(2) is Tier.SLEEPING


def test_an_overdue_block_stays_in_ram_while_ram_is_mostly_free(tmp_path):
    clock = Clock()
    s = store(tmp_path, host_bytes=100_000, clock=clock, max_idle_s=10.0)  # 2 % used
    s.put(block(1, pause_ms=1000))
    clock.now = 2.0
    assert s.sweep() == []  # overdue, but the room is not needed: no disk write
    assert s.tier_of(1) is Tier.SLEEPING
    clock.now = 11.0
    assert s.sweep() == [1]  # max_idle_s still applies
    assert s.tier_of(1) is Tier.ARCHIVED


def test_age_policy_archives_blocks_unread_for_max_idle(tmp_path):
    clock = Clock()
    s = store(tmp_path, policy=DemotionPolicyName.AGE, clock=clock, max_idle_s=10.0)
    s.put(block(1))
    s.put(block(2))
    clock.now = 8.0
    s.get(2)  # a read refreshes it
    clock.now = 11.0
    assert s.sweep() == [1]
    assert s.tier_of(2) is Tier.SLEEPING


def test_never_policy_leaves_ram_to_lru(tmp_path):
    clock = Clock()
    s = store(tmp_path, policy=DemotionPolicyName.NEVER, clock=clock)
    s.put(block(1))
    clock.now = 1e6
    assert s.sweep() == [] and s.tier_of(1) is Tier.SLEEPING


def test_pressure_archives_the_blocks_due_latest_and_lowest_priority_first():
    blocks = [
        SleepingBlock(1, 100, idle_s=1, age_s=1, priority=0, expected_pause_s=60),  # long pause
        SleepingBlock(2, 100, idle_s=1, age_s=1, priority=0, expected_pause_s=2),  # back soon
        SleepingBlock(3, 100, idle_s=1, age_s=1, priority=9, expected_pause_s=60),  # long, but important
    ]
    policy = PauseAwareDemotion(max_idle_s=1e9, high_watermark=0.9, low_watermark=0.5)
    assert keep_score(blocks[0]) > keep_score(blocks[2]) > keep_score(blocks[1])
    assert policy.choose(blocks, used_bytes=300, capacity_bytes=310) == [1, 3]
    assert policy.choose(blocks, used_bytes=300, capacity_bytes=1000) == []  # no pressure, none overdue


def test_changes_mirror_each_tier_and_a_ram_eviction_lands_on_disk(tmp_path):
    s = store(tmp_path, host_bytes=2500)
    for h in (1, 2, 3):
        s.put(block(h))
    changes = s.take_changes()
    assert TierChange(Tier.SLEEPING, False, (1,)) in changes
    assert TierChange(Tier.ARCHIVED, True, (1,)) in changes
    resident = {t: set() for t in Tier}
    for c in changes:
        (resident[c.tier].update if c.stored else resident[c.tier].difference_update)(c.block_hashes)
    assert resident == {t: set(hs) for t, hs in s.resident().items()}
    assert s.counters.num_demoted_to_disk == 1


def test_restart_keeps_the_disk_tier(tmp_path):
    s = store(tmp_path, host_bytes=2500)
    blocks = [block(h) for h in range(1, 6)]
    for b in blocks:
        s.put(b)
    s.sweep()
    archived = [b for b in blocks if s.disk.contains(b.block_hash)]
    assert len(archived) >= 3
    reopened = store(tmp_path, host_bytes=2500)  # a new process: RAM empty, disk index rebuilt
    assert all(reopened.tier_of(b.block_hash) is Tier.ARCHIVED for b in archived)
    assert all(reopened.get(b.block_hash) == b for b in archived)
    assert reopened.tier_of(archived[-1].block_hash) is Tier.SLEEPING  # promoted on access


def test_corrupt_archived_block_is_a_miss_removed_and_announced(tmp_path):
    s = store(tmp_path, host_bytes=1500)
    s.put(block(1))
    s.put(block(2))  # evicts 1 to disk
    path = s.disk.path_of(1)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    s.take_changes()
    assert s.get(1) is None
    assert s.tier_of(1) is None and not path.exists()
    assert s.take_changes() == [TierChange(Tier.ARCHIVED, False, (1,))]


def test_full_disk_is_a_miss_not_a_crash(tmp_path, monkeypatch):
    s = TieredStore(HostTier(0), DiskTier(tmp_path, 1 << 20, fsync=False),
                    make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT))

    def no_space(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    result = s.put(block(1))
    assert not result.stored and s.tier_of(1) is None and s.get(1) is None
    assert s.counters.num_disk_write_errors == 1


def test_tier_changes_become_kv_events_tagged_with_their_tier():
    from services.cachestore.app import change_to_event
    from weft.v1 import events_pb2

    stored = change_to_event(TierChange(Tier.ARCHIVED, True, (5, 6)))
    removed = change_to_event(TierChange(Tier.SLEEPING, False, (5,)))
    assert (stored.kind, stored.tier, list(stored.block_hashes)) == (
        events_pb2.KV_EVENT_KIND_STORED, events_pb2.TIER_ARCHIVED, [5, 6])
    assert (removed.kind, removed.tier) == (events_pb2.KV_EVENT_KIND_REMOVED, events_pb2.TIER_SLEEPING)
