"""Issue 17 (session 3, attack): a pause's demotion queues the session's blocks first in
line for eviction (``DemoteBlocks.evict_first``). It queued the chain's *head* first: the
first block the pool took was the prefix root, and a prefix match stops at the first
missing block, so one block of eviction made the whole paused context unreachable while
the rest of it still sat in the pool. The tail goes first now (as ``BlockPool.free``
orders a finished sequence), whatever order the cachestore already held the blocks in."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.executor.kv.block_pool import BlockPool
from services.executor.tiers.offload import Demoter
from services.shared.block_hash import extra_keys_for, hash_block_chain

BLOCK_SIZE = 2
MODEL_ID = "model-a"
TOKENS = list(range(100, 108))  # a chain of 4 full blocks


def _cache(pool: BlockPool, hashes: list[int]) -> None:
    blocks = pool.allocate(len(hashes))
    pool.cache_full_blocks(blocks, hashes, None)
    pool.free(blocks)


def test_evicting_one_queued_block_leaves_the_rest_of_the_chain_reachable():
    pool = BlockPool(4, BLOCK_SIZE)  # full: every allocation evicts
    chain = hash_block_chain(TOKENS, BLOCK_SIZE)
    _cache(pool, chain)
    assert pool.queue_for_eviction(chain) == 4
    pool.allocate(1)
    assert len(pool.get_cached_blocks(chain)) == 3  # was 0: the root went first


@dataclass(frozen=True)
class _Payload:
    block_hash: int
    size_bytes: int = 1


class _Engine:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    async def call(self, fn):
        return fn(self)


class _Transfer:
    def __init__(self, pool: BlockPool) -> None:
        self.engine = _Engine(pool)

    async def export(self, hashes):
        return [_Payload(h) for h in hashes]


class _Store:
    """Holds some of the chain's blocks already, not a prefix of it (the store's own LRU
    drops single blocks)."""

    def __init__(self, held: set[int]) -> None:
        self.held = held

    async def contains(self, hashes):
        return ["ram" if h in self.held else None for h in hashes]

    async def put_blocks(self, payloads, priority, expected_pause_ms):
        self.held.update(p.block_hash for p in payloads)


def test_a_pause_demotion_queues_the_chain_tail_first_whichever_blocks_the_store_held():
    pool = BlockPool(4, BLOCK_SIZE)
    chain = hash_block_chain(TOKENS, BLOCK_SIZE, extra_keys_for(MODEL_ID, ""))
    _cache(pool, chain)
    demoter = Demoter(_Transfer(pool), _Store({chain[1], chain[3]}), MODEL_ID, BLOCK_SIZE)
    result = asyncio.run(demoter.demote(token_ids=TOKENS, evict_first=True))
    assert (result.num_demoted_blocks, result.num_already_stored_blocks, result.num_evicted_blocks) == (2, 2, 4)
    pool.allocate(1)
    assert len(pool.get_cached_blocks(chain)) == 3  # was 1: the queue followed "stored, then sent"
