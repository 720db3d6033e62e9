"""Demotion policy: which sleeping (host RAM) blocks go down to the archived tier (disk).

Policy apart from mechanism: ``TieredStore.sweep`` asks the policy, the tiers move
bytes. An enum + a small interface + a factory, so an ablation is a flag.

NOTE: a block's *keep score* is how soon it is expected back, weighted by priority::

    due_s   = expected_pause_s if the writer said so, else the idle time so far
    score   = due_s / (1 + priority)              (lower = keep in RAM)

``pause_aware`` demotes a block idle longer than ``max_idle_s``; while RAM is above the
low watermark, also blocks idle longer than their expected pause (plus slack: an overrun
tool call is probably a long one), most overdue first, until RAM is back at the low
watermark (a backlog of overdue blocks is not archived all at once when RAM crosses
it); and under pressure (RAM above the high watermark) the highest scores first until
RAM is under the low watermark. Below the low
watermark an overdue block stays in RAM: the room is not needed, and a disk write (a file
and an fsync per block) would only cost the machine the CPU and I/O its engines share.
Most overdue blocks there are write-backs of KV the executor still holds: the agent
benchmark's sessions sent every hop's blocks down, and all of them reached the disk.
``age`` only uses ``max_idle_s``; ``never`` leaves demotion to LRU eviction.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SleepingBlock:
    """What the policy sees of one host-RAM block."""

    block_hash: int
    size_bytes: int
    idle_s: float  # since it was stored or last read
    age_s: float  # since it was stored
    priority: float  # program priority hint (higher = keep longer)
    expected_pause_s: float  # 0 = unknown


class DemotionPolicyName(enum.Enum):
    NEVER = "never"
    AGE = "age"
    PAUSE_AWARE = "pause_aware"


class DemotionPolicy(Protocol):
    def choose(self, blocks: Sequence[SleepingBlock], used_bytes: int, capacity_bytes: int) -> list[int]:
        """Hashes to demote now, in order. Does not modify anything."""


@dataclass(frozen=True)
class NeverDemote:
    def choose(self, blocks, used_bytes, capacity_bytes) -> list[int]:
        return []


@dataclass(frozen=True)
class AgeDemotion:
    max_idle_s: float = 300.0

    def choose(self, blocks, used_bytes, capacity_bytes) -> list[int]:
        return [b.block_hash for b in blocks if b.idle_s > self.max_idle_s]


def keep_score(b: SleepingBlock) -> float:
    due_s = b.expected_pause_s if b.expected_pause_s > 0 else b.idle_s
    return due_s / (1.0 + max(0.0, b.priority))


def overrun(b: SleepingBlock) -> float:
    """How far past its expected pause a block is, weighted by priority (higher = archive first)."""
    return b.idle_s / b.expected_pause_s / (1.0 + max(0.0, b.priority))


@dataclass(frozen=True)
class PauseAwareDemotion:
    max_idle_s: float = 300.0
    pause_slack: float = 1.5  # an expected pause overrun by this factor is a long pause
    high_watermark: float = 0.9
    low_watermark: float = 0.7

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")

    def choose(self, blocks, used_bytes, capacity_bytes) -> list[int]:
        chosen = {b.block_hash: None for b in blocks if b.idle_s > self.max_idle_s}
        freed = sum(b.size_bytes for b in blocks if b.block_hash in chosen)
        target = self.low_watermark * capacity_bytes
        # Overdue blocks only for the room above the low watermark, most overdue first: a
        # store that crosses it full of overdue blocks archives what it needs, not its whole
        # backlog in one sweep (a file and an fsync each, under the store's lock).
        overdue = [b for b in blocks if b.block_hash not in chosen and b.expected_pause_s > 0
                   and b.idle_s > b.expected_pause_s * self.pause_slack]
        for b in sorted(overdue, key=overrun, reverse=True):
            if not capacity_bytes or used_bytes - freed <= target:
                break
            chosen[b.block_hash] = None
            freed += b.size_bytes
        if capacity_bytes and used_bytes - freed > self.high_watermark * capacity_bytes:
            for b in sorted(blocks, key=keep_score, reverse=True):
                if used_bytes - freed <= target:
                    break
                if b.block_hash not in chosen:
                    chosen[b.block_hash] = None
                    freed += b.size_bytes
        return list(chosen)


def make_demotion_policy(name: DemotionPolicyName, max_idle_s: float = 300.0) -> DemotionPolicy:
    if name is DemotionPolicyName.NEVER:
        return NeverDemote()
    if name is DemotionPolicyName.AGE:
        return AgeDemotion(max_idle_s)
    if name is DemotionPolicyName.PAUSE_AWARE:
        return PauseAwareDemotion(max_idle_s)
    raise ValueError(f"unknown demotion policy {name!r}")
