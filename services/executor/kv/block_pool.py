"""Paged KV block pool: the mechanism. Which blocks to keep is policy, applied elsewhere.

NOTE: every block is in exactly one of three states:

    free-uncached  ref_cnt == 0, no hash         (taken first by ``allocate``)
    free-cached    ref_cnt == 0, hash registered (evictable, least recently freed first)
    in use         ref_cnt  > 0                  (never evicted)

A prefix-cache hit takes a reference on a block, pulling it out of the free-cached
queue if nobody held it. Registering a hash emits ``BlockStored``; losing one (eviction,
reset) emits ``BlockRemoved``, so a subscriber's view of "which hashes live here" is
exactly the pool's.

Logical partitions (per tenant / class): each partition has ``reserved_blocks`` that
nobody else may take, and may borrow beyond them up to ``credit_blocks``. A partition's
use is the number of distinct blocks its sequences hold; a block held by two
partitions counts against both (quotas stay conservative). Borrowers are what the
engine reclaims first when memory runs out (see ``borrowed_blocks``).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.shared.block_hash import BlockHash
from services.shared.vocabulary import DEFAULT_PARTITION


@dataclass(frozen=True)
class PartitionSpec:
    """Quota of one logical partition, in blocks."""

    name: str
    reserved_blocks: int = 0
    credit_blocks: int = 0

    def __post_init__(self) -> None:
        if self.reserved_blocks < 0 or self.credit_blocks < 0:
            raise ValueError(f"partition {self.name!r}: reserved and credit must be >= 0")

    @property
    def limit_blocks(self) -> int:
        return self.reserved_blocks + self.credit_blocks


@dataclass(frozen=True)
class BlockStored:
    """Hashes that became resident here, in chain order; ``parent_hash`` precedes the first."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    partition: str


@dataclass(frozen=True)
class BlockRemoved:
    """Hashes no longer resident here."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every hash this pool announced is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "holders")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.holders: dict[str, int] = {}  # partition -> references it holds

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


@dataclass(frozen=True)
class PartitionUsage:
    name: str
    used_blocks: int
    reserved_blocks: int
    credit_blocks: int

    @property
    def borrowed_blocks(self) -> int:
        return max(0, self.used_blocks - self.reserved_blocks)


class BlockPool:
    """Allocates, ref-counts, hashes and evicts KV blocks; queues kv events."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        partitions: Sequence[PartitionSpec] = (),
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_uncached: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._free_cached: OrderedDict[int, Block] = OrderedDict()  # LRU first
        self._cached: dict[BlockHash, Block] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}  # resident hash -> its chain parent
        self._num_children: dict[BlockHash, int] = {}  # resident hash -> resident hashes chained on it
        self._events: list[KVEvent] = []
        self._specs: dict[str, PartitionSpec] = {}
        self._used: dict[str, int] = {}
        self.set_partitions(partitions)

    # -- partitions -------------------------------------------------------------
    def set_partitions(self, partitions: Sequence[PartitionSpec]) -> None:
        """Replace the quota table (usage is kept). An unknown partition name used later
        falls back to the ``default`` partition's quota."""
        specs = {p.name: p for p in partitions}
        if sum(p.reserved_blocks for p in specs.values()) > self.num_blocks:
            raise ValueError("reserved blocks of all partitions exceed the pool")
        specs.setdefault(DEFAULT_PARTITION, PartitionSpec(DEFAULT_PARTITION, 0, self.num_blocks))
        self._specs = specs
        for name in specs:
            self._used.setdefault(name, 0)

    def spec(self, partition: str) -> PartitionSpec:
        return self._specs.get(partition) or self._specs[DEFAULT_PARTITION]

    def usage(self) -> list[PartitionUsage]:
        """Snapshot of every partition's use (does not modify the pool)."""
        return [
            PartitionUsage(n, self._used.get(n, 0), s.reserved_blocks, s.credit_blocks)
            for n, s in self._specs.items()
        ] + [
            PartitionUsage(n, u, 0, 0) for n, u in self._used.items() if n not in self._specs and u
        ]

    def used_blocks(self, partition: str) -> int:
        return self._used.get(partition, 0)

    def borrowed_blocks(self, partition: str) -> int:
        return max(0, self._used.get(partition, 0) - self.spec(partition).reserved_blocks)

    def _protected_for_others(self, partition: str) -> int:
        """Free blocks that other partitions' unused reservations hold back."""
        return sum(
            max(0, s.reserved_blocks - self._used.get(n, 0))
            for n, s in self._specs.items()
            if n != partition
        )

    # -- capacity ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def can_allocate(self, num_new: int, partition: str = DEFAULT_PARTITION, hits: Iterable[Block] = ()) -> bool:
        """Whether ``num_new`` fresh blocks plus references on the cache ``hits`` fit both
        the pool and the partition's quota. Does not modify the pool."""
        hits = list(hits)
        new_to_partition = num_new + sum(1 for b in hits if partition not in b.holders)
        if self._used.get(partition, 0) + new_to_partition > self.spec(partition).limit_blocks:
            return False
        protected = self._protected_for_others(partition)
        taken_from_free = num_new + sum(1 for b in hits if b.ref_cnt == 0)
        if self.num_free_blocks - taken_from_free < protected:
            return False
        # Count every partition's holdings in full too: a hit on a block another
        # partition holds takes no free block now, but once that partition lets go the
        # block is ours alone, and others' reservations must still be coverable then.
        unheld = self.num_blocks - sum(self._used.values())
        return unheld - new_to_partition >= protected

    def usage_allows(self, num_blocks: int, partition: str) -> bool:
        """Whether the partition's quota alone admits ``num_blocks`` more references."""
        return self._used.get(partition, 0) + num_blocks <= self.spec(partition).limit_blocks

    # -- prefix cache -----------------------------------------------------------
    def get_cached_blocks(self, block_hashes: Sequence[BlockHash]) -> list[Block]:
        """Longest prefix of ``block_hashes`` resident here. Does not take references:
        the result is valid only until the pool is next modified."""
        hits: list[Block] = []
        if not self.enable_prefix_caching:
            return hits
        for h in block_hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def cached_block(self, block_hash: BlockHash) -> Block | None:
        """The block holding ``block_hash``, or None. Does not take a reference or touch
        recency: the result is valid only until the pool is next modified."""
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash resident here (for a subscriber's resync). Does not modify the pool."""
        return list(self._cached)

    # -- allocation -------------------------------------------------------------
    def _hold(self, block: Block, partition: str) -> None:
        block.ref_cnt += 1
        held = block.holders.get(partition, 0)
        if held == 0:
            self._used[partition] = self._used.get(partition, 0) + 1
        block.holders[partition] = held + 1

    def touch(self, blocks: Iterable[Block], partition: str = DEFAULT_PARTITION) -> None:
        """Take a reference on each (cache-hit) block for ``partition``."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_cached.pop(block.block_id, None)
                self._free_uncached.pop(block.block_id, None)
            self._hold(block, partition)

    def allocate(self, num_blocks: int, partition: str = DEFAULT_PARTITION) -> list[Block] | None:
        """Take ``num_blocks`` fresh blocks for ``partition`` (ref_cnt 1 each), evicting
        least recently freed cached blocks when needed; None when they do not fit."""
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        if not self.can_allocate(num_blocks, partition):
            return None
        out: list[Block] = []
        removed: list[BlockHash] = []
        for _ in range(num_blocks):
            if self._free_uncached:
                _, block = self._free_uncached.popitem(last=False)
            else:
                _, block = self._free_cached.popitem(last=False)
                if block.block_hash is not None:
                    removed.append(block.block_hash)
                    self._forget(block.block_hash)
                    block.block_hash = None
            self._hold(block, partition)
            out.append(block)
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))
        return out

    def free(self, blocks: Sequence[Block], partition: str = DEFAULT_PARTITION) -> None:
        """Drop one reference on each block of a sequence. Blocks reaching zero become
        evictable, the sequence's tail first (a prefix outlives its suffixes)."""
        for block in reversed(blocks):
            held = block.holders.get(partition, 0)
            if block.ref_cnt <= 0 or held <= 0:
                raise ValueError(f"block {block.block_id} is not held by partition {partition!r}")
            block.ref_cnt -= 1
            if held == 1:
                del block.holders[partition]
                self._used[partition] -= 1
            else:
                block.holders[partition] = held - 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._free_cached[block.block_id] = block
                else:
                    self._free_uncached[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        partition: str = DEFAULT_PARTITION,
    ) -> None:
        """Register hashes of newly *full and computed* blocks (in chain order). A hash
        already resident on another block leaves this block uncached (a duplicate)."""
        if not self.enable_prefix_caching:
            return
        # One BlockStored per unbroken run: a duplicate (hash already resident on another
        # block) in the middle would otherwise make a subscriber chain across it.
        run: list[BlockHash] = []
        parent = run_parent = parent_hash
        for block, h in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or h in self._cached:
                if run:
                    self._events.append(BlockStored(tuple(run), run_parent, partition))
                    run = []
                parent = h
                continue
            block.block_hash = h
            self._cached[h] = block
            self._parent[h] = parent
            if parent is not None:
                self._num_children[parent] = self._num_children.get(parent, 0) + 1
            if not run:
                run_parent = parent
            run.append(h)
            parent = h
        if run:
            self._events.append(BlockStored(tuple(run), run_parent, partition))

    def _forget(self, block_hash: BlockHash) -> None:
        del self._cached[block_hash]
        parent = self._parent.pop(block_hash, None)
        if parent is not None and self._num_children.get(parent, 0) > 1:
            self._num_children[parent] -= 1
        else:
            self._num_children.pop(parent, None)

    def evict_cached(self, block_hashes: Iterable[BlockHash]) -> int:
        """Forget the given hashes where their blocks are free (e.g. a released session's
        stale tail); returns how many were dropped. Held blocks are left alone."""
        removed = []
        for h in block_hashes:
            block = self._cached.get(h)
            if block is None or block.ref_cnt > 0:
                continue
            self._forget(h)
            self._free_cached.pop(block.block_id)
            block.block_hash = None
            self._free_uncached[block.block_id] = block
            removed.append(h)
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))
        return len(removed)

    def queue_for_eviction(self, block_hashes: Iterable[BlockHash]) -> int:
        """Put the given hashes' blocks (a chain, in chain order), where free, first in
        line for eviction (the LRU end an allocation takes from), the chain's tail first as
        ``free`` does: a prefix outlives its suffixes, so an eviction of a few blocks
        leaves the rest of the chain reachable by a prefix match. Returns how many moved.
        Held blocks are left alone: they join the queue by recency when released."""
        chain = list(block_hashes)
        # a block another resident chain continues stays in line by recency, with its
        # ancestors: evicted first, it would orphan that chain's blocks (unreachable, still held)
        cut = 0
        for i, h in enumerate(chain):
            inside = 1 if i + 1 < len(chain) and self._parent.get(chain[i + 1]) == h else 0
            if self._num_children.get(h, 0) > inside:
                cut = i + 1
        moved = [self._cached[h] for h in chain[cut:]
                 if h in self._cached and self._cached[h].ref_cnt == 0]
        for block in moved:  # each goes before the ones moved earlier: the last hash ends up first
            self._free_cached.move_to_end(block.block_id, last=False)
        return len(moved)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible when no block is in use."""
        if any(b.ref_cnt for b in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._parent.clear()
        self._num_children.clear()
        self._free_cached.clear()
        self._free_uncached = OrderedDict((b.block_id, b) for b in self.blocks)
        self._events.append(AllBlocksCleared())
        return True

    # -- events -----------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """Drain the queued kv events (oldest first)."""
        events, self._events = self._events, []
        return events
