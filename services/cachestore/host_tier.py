"""The sleeping tier: blocks in host RAM, bounded by bytes, least recently used evicted.

Mechanism only: ``put`` returns what it evicted so the caller's policy can demote it.
Not thread-safe on its own; ``TieredStore`` serialises access.
"""
from __future__ import annotations

from collections import OrderedDict

from services.cachestore.blocks import Block


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0

    def can_hold(self, size_bytes: int) -> bool:
        return size_bytes <= self.capacity_bytes

    def put(self, block: Block) -> list[Block] | None:
        """Store ``block`` (replacing one with the same hash), evicting LRU blocks to make
        room; returns the evicted blocks, or None when it can never fit."""
        if not self.can_hold(block.size_bytes):
            return None
        self.remove(block.block_hash)
        evicted = []
        while self.used_bytes + block.size_bytes > self.capacity_bytes:
            _, old = self._blocks.popitem(last=False)
            self.used_bytes -= old.size_bytes
            self.num_evictions += 1
            evicted.append(old)
        self._blocks[block.block_hash] = block
        self.used_bytes += block.size_bytes
        return evicted

    def get(self, block_hash: int) -> Block | None:
        """The block, marked most recently used; None (a miss) when absent."""
        block = self._blocks.get(block_hash)
        if block is None:
            self.num_misses += 1
            return None
        self._blocks.move_to_end(block_hash)
        self.num_hits += 1
        return block

    def contains(self, block_hash: int) -> bool:
        """Does not touch recency or counters."""
        return block_hash in self._blocks

    def remove(self, block_hash: int) -> Block | None:
        block = self._blocks.pop(block_hash, None)
        if block is not None:
            self.used_bytes -= block.size_bytes
        return block

    def blocks(self) -> list[Block]:
        """Every block, least recently used first. Does not touch recency."""
        return list(self._blocks.values())

    def __len__(self) -> int:
        return len(self._blocks)
