"""Which executor holds which block hash, from kv events.

NOTE: the index is a hint for placement, never a source of truth. A missed event can
only make placement worse, so on any doubt (sequence gap, source restart, executor
expiry) the source's entries are dropped and rebuilt from its next events; a stale
"stored" would steer requests to an executor that no longer has the prefix.

    hash -> {executor, ...}         (lookup by prompt block)
    executor -> {hash, ...}         (removal of a whole source)

Blocks in a cachestore tier (sleeping = host RAM, archived = disk) are kept apart: they
make no executor a prefix holder, but any executor can load them, so placement counts
them as cheaper-than-compute work for every candidate (``num_store_blocks``).

    hash -> {(cachestore, tier), ...}      least recently stored first

Memory: the executor side mirrors the executors' prefix caches, so it is bounded by
their pools (removals arrive as kv.removed events; a gap or expiry drops the source).
The cachestore side mirrors a disk tier that may hold millions of blocks, so it keeps
at most ``max_store_blocks`` hashes (~0.4 KB each) and forgets the least recently stored
beyond that: a forgotten block only stops counting as cheap in placement.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class KvIndex:
    """Block hash → executors holding it. Not thread-safe (event loop only)."""

    def __init__(self, max_store_blocks: int = 0) -> None:
        """``max_store_blocks``: most cachestore-tier hashes kept (0: unbounded)."""
        if max_store_blocks < 0:
            raise ValueError(f"max_store_blocks must be >= 0, got {max_store_blocks}")
        self.max_store_blocks = max_store_blocks
        self.num_store_forgotten = 0  # store hashes dropped by the bound
        self._holders: dict[int, set[str]] = {}
        self._by_source: dict[str, set[int]] = {}
        self._in_store: OrderedDict[int, set[tuple[str, str]]] = OrderedDict()
        self._store_by_source: dict[str, set[tuple[int, str]]] = {}

    def stored(self, source: str, block_hashes: Iterable[int]) -> None:
        owned = self._by_source.setdefault(source, set())
        for h in block_hashes:
            self._holders.setdefault(h, set()).add(source)
            owned.add(h)

    def removed(self, source: str, block_hashes: Iterable[int]) -> None:
        owned = self._by_source.get(source)
        if not owned:
            return
        for h in block_hashes:
            owned.discard(h)
            self._discard(h, source)

    def drop_source(self, source: str) -> int:
        """Forget every hash of ``source`` (cleared, gap, restart, expiry); returns how many."""
        owned = self._by_source.pop(source, set())
        for h in owned:
            self._discard(h, source)
        return len(owned)

    def _discard(self, block_hash: int, source: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(source)
            if not holders:
                del self._holders[block_hash]

    def match_prefix(self, block_hashes: Sequence[int], sources: Iterable[str] | None = None) -> dict[str, int]:
        """Per executor, how many *leading* blocks of ``block_hashes`` it holds (only
        executors with at least one). Does not modify the index."""
        alive = set(sources) if sources is not None else None
        matched: dict[str, int] = {}
        for i, h in enumerate(block_hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for name in alive:
                matched[name] = i + 1
        return matched

    def num_blocks(self, source: str) -> int:
        return len(self._by_source.get(source, ()))

    def holders(self, block_hash: int) -> frozenset[str]:
        return frozenset(self._holders.get(block_hash, ()))

    # -- cachestore tiers ---------------------------------------------------------
    def store_stored(self, source: str, tier: str, block_hashes: Iterable[int]) -> None:
        owned = self._store_by_source.setdefault(source, set())
        for h in block_hashes:
            holders = self._in_store.get(h)
            if holders is None:
                holders = self._in_store[h] = set()
            else:
                self._in_store.move_to_end(h)
            holders.add((source, tier))
            owned.add((h, tier))
        while self.max_store_blocks and len(self._in_store) > self.max_store_blocks:
            h, holders = self._in_store.popitem(last=False)
            for holder, held_tier in holders:
                self._store_by_source.get(holder, set()).discard((h, held_tier))
            self.num_store_forgotten += 1

    def store_removed(self, source: str, tier: str, block_hashes: Iterable[int]) -> None:
        owned = self._store_by_source.get(source)
        if not owned:
            return
        for h in block_hashes:
            owned.discard((h, tier))
            self._discard_store(h, source, tier)

    def drop_store(self, source: str) -> int:
        """Forget every block of cachestore ``source`` (gap, restart, cleared)."""
        owned = self._store_by_source.pop(source, set())
        for h, tier in owned:
            self._discard_store(h, source, tier)
        return len(owned)

    def _discard_store(self, block_hash: int, source: str, tier: str) -> None:
        holders = self._in_store.get(block_hash)
        if holders is not None:
            holders.discard((source, tier))
            if not holders:
                del self._in_store[block_hash]

    def num_store_blocks(self, block_hashes: Sequence[int], start: int = 0) -> int:
        """How many blocks of ``block_hashes`` from ``start`` on, without a gap, some
        cachestore tier holds. Does not modify the index."""
        n = 0
        for h in block_hashes[start:]:
            if h not in self._in_store:
                break
            n += 1
        return n

    def store_tiers(self, block_hash: int) -> frozenset[str]:
        return frozenset(tier for _, tier in self._in_store.get(block_hash, ()))

    def num_hashes(self) -> tuple[int, int]:
        """(executor-held hashes, cachestore-held hashes) indexed; does not modify."""
        return len(self._holders), len(self._in_store)
