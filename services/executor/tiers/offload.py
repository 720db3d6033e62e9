"""Offload: the executor copies cached KV blocks from its GPU / CPU pool to the cachestore
(the store's host-RAM "sleeping" tier).

Words: this module is the executor's *offload* (pool → cachestore). In the cachestore,
*demotion* means something else: moving a block down its own tiers, RAM → disk
(services/cachestore/disk_demotion.py). The wire and flag vocabulary here predates that
split and stays as it is: the ``DemoteBlocks`` RPC, ``--demote-on-finish``, the
``weft_executor_demoted_blocks_total`` metric, the ``Demoter`` class and its log events.

Used three ways: the ``DemoteBlocks`` RPC (the scheduler's pause policy, explicit
demand), and automatically when a request finishes (``DemoteOnFinish``: a session's
blocks, or every request's, are written back so a later hop finds them even after the
local pool evicted them under pressure). Only blocks the store does not already hold
are sent; exporting copies the bytes on the engine thread, the upload runs outside it.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from services.shared.block_hash import extra_keys_for, hash_block_chain
from services.executor.tiers.kv_transfer import KvTransfer
from services.executor.tiers.tier_client import TierClient
from services.mesh import metrics

log = structlog.get_logger(__name__)

DEMOTED_BLOCKS = metrics.counter("weft_executor_demoted_blocks_total", "Blocks written to the cachestore.")


class DemoteOnFinish(enum.Enum):
    NEVER = "never"
    SESSIONS = "sessions"  # requests that carry a session id
    ALL = "all"


@dataclass(frozen=True)
class DemotionResult:
    num_demoted_blocks: int
    num_already_stored_blocks: int
    num_missing_blocks: int
    demoted_bytes: int
    num_evicted_blocks: int


class Demoter:
    def __init__(self, transfer: KvTransfer, client: TierClient, model_id: str, block_size: int) -> None:
        self.transfer = transfer
        self.client = client
        self.model_id = model_id
        self.block_size = block_size

    def sequence_hashes(self, token_ids: Sequence[int], tenant_salt: str) -> list[int]:
        return hash_block_chain(list(token_ids), self.block_size, extra_keys_for(self.model_id, tenant_salt))

    async def demote(self, block_hashes: Sequence[int] = (), token_ids: Sequence[int] = (), tenant_salt: str = "",
                     priority: float = 0.0, expected_pause_ms: int = 0, evict_local: bool = False,
                     evict_first: bool = False) -> DemotionResult:
        """Send the named blocks the store lacks. ``evict_local``: then forget the local
        copies the store holds; ``evict_first``: keep them, first in line for eviction (a
        pause's demotion: a resume before the pool needs the room finds them here).
        Raises the store's gRPC error when the upload fails (the local copies are then
        kept in their place, whatever the flags say)."""
        hashes = list(dict.fromkeys([*block_hashes, *self.sequence_hashes(token_ids, tenant_salt)]))
        if not hashes:
            return DemotionResult(0, 0, 0, 0, 0)
        tiers = await self.client.contains(hashes)
        stored = [h for h, t in zip(hashes, tiers) if t is not None]
        todo = [h for h, t in zip(hashes, tiers) if t is None]
        payloads = await self.transfer.export(todo)
        missing = len(todo) - len(payloads)
        sent_bytes = 0
        if payloads:
            await self.client.put_blocks(payloads, priority, expected_pause_ms)
            sent_bytes = sum(p.size_bytes for p in payloads)
            DEMOTED_BLOCKS.inc(len(payloads))
        evicted = 0
        held_by_store = {*stored, *(p.block_hash for p in payloads)}
        safe = [h for h in hashes if h in held_by_store]  # chain order, whichever the store held before
        if evict_local:
            evicted = await self.transfer.engine.call(lambda e: e.pool.evict_cached(safe))
        elif evict_first:
            evicted = await self.transfer.engine.call(lambda e: e.pool.queue_for_eviction(safe))
        log.info("blocks_demoted", num_demoted=len(payloads), num_already_stored=len(stored),
                 num_missing=missing, num_evicted=evicted)
        return DemotionResult(len(payloads), len(stored), missing, sent_bytes, evicted)
