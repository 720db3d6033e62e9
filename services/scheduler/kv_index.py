"""Which executor holds which block hash, from kv events.

NOTE: the index is a hint for placement, never a source of truth. A missed event can
only make placement worse, so on any doubt (sequence gap, source restart, executor
expiry) the source's entries are dropped and rebuilt from its next events; a stale
"stored" would steer requests to an executor that no longer has the prefix.

    hash -> {executor, ...}         (lookup by prompt block)
    executor -> {hash, ...}         (removal of a whole source)
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


class KvIndex:
    """Block hash → executors holding it. Not thread-safe (event loop only)."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._by_source: dict[str, set[int]] = {}

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
