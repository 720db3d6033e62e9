"""BlockPool eviction order: least recently freed first, uncached before cached, a
sequence's tail before its prefix."""
from __future__ import annotations

from services.shared.block_hash import hash_block_chain
from services.executor.kv.block_pool import Block, BlockPool, BlockRemoved

BLOCK_SIZE = 2


def _cached_seq(pool: BlockPool, tokens: list[int]) -> tuple[list[Block], list[int]]:
    hashes = hash_block_chain(tokens, BLOCK_SIZE)
    blocks = pool.allocate(len(hashes))
    pool.cache_full_blocks(blocks, hashes, None)
    return blocks, hashes


def _evicted_by_allocating(pool: BlockPool, n: int) -> list[int]:
    pool.take_events()
    assert pool.allocate(n) is not None
    return [h for ev in pool.take_events() if isinstance(ev, BlockRemoved) for h in ev.block_hashes]


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(4, BLOCK_SIZE)
    a_blocks, a_hashes = _cached_seq(pool, [1, 1, 1, 2])
    b_blocks, b_hashes = _cached_seq(pool, [2, 2, 2, 1])
    pool.free(a_blocks)
    pool.free(b_blocks)
    assert _evicted_by_allocating(pool, 2) == [a_hashes[1], a_hashes[0]]
    assert all(pool.contains(h) for h in b_hashes)


def test_a_cache_hit_makes_a_block_most_recently_used_again():
    pool = BlockPool(2, BLOCK_SIZE)
    a_blocks, (a_hash,) = _cached_seq(pool, [1, 1])
    b_blocks, (b_hash,) = _cached_seq(pool, [2, 2])
    pool.free(a_blocks)
    pool.free(b_blocks)
    hit = pool.get_cached_blocks([a_hash])
    pool.touch(hit)
    pool.free(hit)
    assert _evicted_by_allocating(pool, 1) == [b_hash]
    assert pool.contains(a_hash)


def test_uncached_free_blocks_are_used_before_cached_ones():
    pool = BlockPool(4, BLOCK_SIZE)
    blocks, hashes = _cached_seq(pool, [1, 1, 2, 2])
    pool.free(blocks)
    taken = pool.allocate(2)
    assert {b.block_id for b in taken}.isdisjoint(b.block_id for b in blocks)
    assert all(pool.contains(h) for h in hashes)
    assert not [ev for ev in pool.take_events() if isinstance(ev, BlockRemoved)]


def test_freeing_a_sequence_makes_its_tail_evictable_before_its_prefix():
    pool = BlockPool(3, BLOCK_SIZE)
    blocks, hashes = _cached_seq(pool, [1, 1, 2, 2, 3, 3])
    pool.free(blocks)
    assert _evicted_by_allocating(pool, 1) == [hashes[2]]
    assert pool.get_cached_blocks(hashes) == blocks[:2]
    assert _evicted_by_allocating(pool, 1) == [hashes[1]]
