"""pause_aware demotion at its edges (services/cachestore/disk_demotion.py): an overdue
block goes to disk only for room above the low watermark, ``max_idle_s`` archives
regardless, and a store that crosses the watermark full of overdue blocks archives the
room it needs, not its whole backlog in one sweep under the store's lock."""
from __future__ import annotations

import os

import pytest

from services.cachestore.blocks import Block, BlockMeta, checksum
from services.cachestore.disk_demotion import DemotionPolicyName, PauseAwareDemotion, SleepingBlock, \
    make_demotion_policy
from services.cachestore.disk_tier import DiskTier
from services.cachestore.host_tier import HostTier
from services.cachestore.tiers import Tier, TieredStore, TierPolicyName, make_tier_policy

SIZE = 1000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def block(h: int, pause_ms: int = 0, priority: float = 0.0) -> Block:
    payload = os.urandom(SIZE)
    return Block(BlockMeta(h, "uint8", (SIZE,), SIZE, checksum(payload), "m", 16, priority, pause_ms), payload)


def store(tmp_path, host_bytes: int, clock: Clock, max_idle_s: float = 1e9) -> TieredStore:
    return TieredStore(HostTier(host_bytes), DiskTier(tmp_path, 1 << 24, fsync=False),
                       make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT),
                       make_demotion_policy(DemotionPolicyName.PAUSE_AWARE, max_idle_s), clock=clock)


def sleeping(h: int, idle_s: float, pause_s: float, priority: float = 0.0) -> SleepingBlock:
    return SleepingBlock(h, SIZE, idle_s=idle_s, age_s=idle_s, priority=priority, expected_pause_s=pause_s)


def test_a_store_crossing_the_low_watermark_full_of_overdue_blocks_archives_only_the_room_it_needs(tmp_path):
    """69 % of RAM overdue (tool calls that never came back) sits in RAM; a burst takes it
    to 91 %. The sweep archives the most overdue blocks until RAM is at the low watermark
    (21 blocks), not all 69 at once: on the old code every overdue block went down in the
    one sweep, a file each, holding the store's lock, for room nobody needed."""
    clock = Clock()
    s = store(tmp_path, 100 * SIZE, clock)
    for h in range(69):
        s.put(block(h, pause_ms=1000 + 10 * h))  # the earliest-stored pause the least overrun
    clock.now = 60.0
    assert s.sweep() == []  # 69 %: below the low watermark, nothing written
    for h in range(100, 122):
        s.put(block(h))  # a burst of fresh blocks: 91 %
    demoted = s.sweep()
    assert len(demoted) == 21 and s.host.used_bytes == 70 * SIZE
    assert sorted(demoted) == list(range(21))  # the most overrun first
    assert all(s.tier_of(h) is Tier.SLEEPING for h in range(100, 122))


def test_used_exactly_at_the_low_watermark_archives_no_overdue_block():
    policy = PauseAwareDemotion(max_idle_s=1e9)
    blocks = [sleeping(h, idle_s=100, pause_s=1) for h in range(7)]
    assert policy.choose(blocks, used_bytes=7 * SIZE, capacity_bytes=10 * SIZE) == []
    assert len(policy.choose(blocks, used_bytes=7 * SIZE + 1, capacity_bytes=10 * SIZE)) == 1


def test_capacity_zero_archives_only_by_max_idle():
    policy = PauseAwareDemotion(max_idle_s=30)
    blocks = [sleeping(1, idle_s=100, pause_s=1), sleeping(2, idle_s=10, pause_s=1), sleeping(3, idle_s=31, pause_s=0)]
    assert policy.choose(blocks, used_bytes=3 * SIZE, capacity_bytes=0) == [1, 3]


def test_blocks_with_pause_zero_are_never_overdue_but_max_idle_still_archives(tmp_path):
    clock = Clock()
    s = store(tmp_path, 10 * SIZE, clock, max_idle_s=50)
    for h in range(9):  # 90 %: above the low watermark, under the high one
        s.put(block(h))  # pause unknown
    clock.now = 49.0
    assert s.sweep() == []
    clock.now = 51.0
    assert sorted(s.sweep()) == list(range(9))


def test_max_idle_blocks_count_toward_the_room_before_any_overdue_block_goes():
    policy = PauseAwareDemotion(max_idle_s=100)
    blocks = [sleeping(1, idle_s=500, pause_s=0), sleeping(2, idle_s=50, pause_s=1)]
    assert policy.choose(blocks, used_bytes=8 * SIZE, capacity_bytes=10 * SIZE) == [1]  # 80 % -> 70 %


def test_a_higher_priority_overdue_block_stays_longer():
    policy = PauseAwareDemotion(max_idle_s=1e9)
    blocks = [sleeping(1, idle_s=10, pause_s=1, priority=9), sleeping(2, idle_s=5, pause_s=1)]
    assert policy.choose(blocks, used_bytes=8 * SIZE, capacity_bytes=10 * SIZE) == [2]


@pytest.mark.parametrize("used_blocks", [0, 5, 7, 8, 10, 12])
def test_overdue_blocks_bring_ram_to_the_low_watermark_and_no_lower(used_blocks):
    policy = PauseAwareDemotion(max_idle_s=1e9)  # low 0.7, high 0.9
    blocks = [sleeping(h, idle_s=h % 3 + 2, pause_s=1) for h in range(used_blocks)]  # all overdue
    left = used_blocks - len(policy.choose(blocks, used_bytes=used_blocks * SIZE, capacity_bytes=10 * SIZE))
    assert left == min(used_blocks, 7)
