"""Pinned sessions: the *keep* decision of a tool-call pause, applied in the pool.

NOTE: when an agent hop finishes and the scheduler chose *keep*, the engine takes one
extra reference on each of the hop's full (hashed) blocks before the sequence frees
its own. A referenced block is never on a free queue, so LRU eviction cannot take it
while the tool runs; the next hop of the session hits it as an ordinary prefix hit.
A pin ends when the session's next hop finishes (it re-pins or not), on
``release`` (intent shift, end of program) or when its TTL runs out, whichever is
first. Pins are charged to the sequence's partition: a tenant's pins count against its
own quota, never against another tenant's reserved share.

Not on the hot path: ``pin`` / ``release`` run when a request finishes or on an RPC;
``expire`` costs one comparison per step until the earliest expiry is due.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.executor.kv.block_pool import Block, BlockPool


@dataclass
class _Pin:
    blocks: list[Block]
    partition: str
    expires_at_s: float


class PinTable:
    """Session id → the blocks pinned for it. Mutates the pool (takes and drops references)."""

    def __init__(self, pool: BlockPool, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.clock = clock
        self._pins: dict[str, _Pin] = {}
        self.next_expiry_s = float("inf")

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._pins

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(p.blocks) for p in self._pins.values())

    def pinned_blocks(self, session_id: str) -> list[Block]:
        pin = self._pins.get(session_id)
        return list(pin.blocks) if pin else []

    def pin(self, session_id: str, blocks: list[Block], partition: str, ttl_s: float) -> int:
        """Replace the session's pin with references on the hashed ones of ``blocks``
        (which the caller still holds) for ``ttl_s``; returns the number pinned."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.release(session_id)
        hashed = [b for b in blocks if b.block_hash is not None]
        if not hashed:
            return 0
        self.pool.touch(hashed, partition)
        expires = self.clock() + ttl_s
        self._pins[session_id] = _Pin(hashed, partition, expires)
        self.next_expiry_s = min(self.next_expiry_s, expires)
        return len(hashed)

    def release(self, session_id: str) -> int:
        """Drop the session's pin (its blocks become evictable, tail first); returns how
        many blocks were unpinned (0 when none)."""
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return 0
        self.pool.free(pin.blocks, pin.partition)
        return len(pin.blocks)

    def _gain(self, pin: _Pin, requester: str | None) -> int:
        """Blocks ``requester``'s partition could take once ``pin`` goes: those only the pin
        holds, less any that fall back into the pin's partition's unused reservation."""
        only_pin = sum(1 for b in pin.blocks if b.ref_cnt == 1)
        if requester is None or pin.partition == requester:
            return only_pin
        reserved = self.pool.spec(pin.partition).reserved_blocks
        used = self.pool.used_blocks(pin.partition)
        return only_pin - (max(0, reserved - (used - only_pin)) - max(0, reserved - used))

    def release_for(self, partition: str | None, num_blocks: int, spare: str = "",
                    requester: str | None = None) -> int:
        """Live work comes first: release ``partition``'s pins (None: anyone's) until
        ``num_blocks`` blocks were unpinned (or none are left); returns how many. The pin
        expiring last goes first: its session is expected back last (the pin's TTL is a
        multiple of its expected pause), so its blocks are the ones the pool will miss
        last (Belady's rule). ``spare``: a session whose pin stays (the requester's own).
        ``requester``: the asking request's partition; a pin counts only the blocks it
        alone holds that this partition could then take (not ones others still hold, nor
        ones that fall back into the pin's partition's reservation), and a pin that would
        free none stays."""
        freed = 0
        for sid in sorted((sid for sid, p in self._pins.items()
                           if partition in (None, p.partition) and sid != spare),
                          key=lambda sid: self._pins[sid].expires_at_s, reverse=True):
            if freed >= num_blocks:
                break
            gain = self._gain(self._pins[sid], requester)
            if gain > 0:  # a pin whose blocks others hold (or its owner reserves) helps no one
                self.release(sid)
                freed += gain
        return freed

    def expire(self, now_s: float | None = None) -> list[str]:
        """Release every pin whose TTL ran out; returns their session ids."""
        now_s = self.clock() if now_s is None else now_s
        if now_s < self.next_expiry_s:
            return []
        done = [sid for sid, p in self._pins.items() if p.expires_at_s <= now_s]
        for sid in done:
            self.release(sid)
        self.next_expiry_s = min((p.expires_at_s for p in self._pins.values()), default=float("inf"))
        return done
