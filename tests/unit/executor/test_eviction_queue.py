"""A pause's demotion keeps the session's blocks local, first in line for eviction.

Before, the scheduler's demotion forgot the local copies as soon as the cachestore held
them, so a hop resuming on a pool that had room anyway loaded its context back over the
network (or recomputed it) while an unhinted request's blocks simply stayed cached: the
agent hints lost KV an LRU would have kept."""
from __future__ import annotations

from services.executor.kv.block_pool import BlockPool
from services.shared.block_hash import hash_block_chain

BLOCK_SIZE = 2


def _cache(pool: BlockPool, tokens: list[int]) -> list[int]:
    hashes = hash_block_chain(tokens, BLOCK_SIZE)
    blocks = pool.allocate(len(hashes))
    pool.cache_full_blocks(blocks, hashes, None)
    pool.free(blocks)
    return hashes


def test_queued_blocks_stay_cached_until_the_pool_needs_room():
    pool = BlockPool(6, BLOCK_SIZE)
    old = _cache(pool, [1, 2, 3, 4])  # least recently used
    paused = _cache(pool, [5, 6, 7, 8])
    assert pool.queue_for_eviction(paused) == 2
    assert len(pool.get_cached_blocks(paused)) == 2  # still here: nothing needed the room
    pool.allocate(2)  # two uncached blocks are free: they go first, nothing cached is lost
    assert len(pool.get_cached_blocks(paused)) == 2 and len(pool.get_cached_blocks(old)) == 2
    pool.allocate(2)  # now the pool must evict: the queued blocks go before older ones
    assert pool.get_cached_blocks(paused) == []
    assert len(pool.get_cached_blocks(old)) == 2


def test_held_and_unknown_blocks_are_left_alone():
    pool = BlockPool(4, BLOCK_SIZE)
    hashes = hash_block_chain([1, 2, 3, 4], BLOCK_SIZE)
    held = pool.allocate(2)
    pool.cache_full_blocks(held, hashes, None)
    assert pool.queue_for_eviction([*hashes, 12345]) == 0  # held by a running sequence, and a stranger
    pool.free(held)
    assert pool.queue_for_eviction(hashes) == 2
