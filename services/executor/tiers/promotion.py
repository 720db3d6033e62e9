"""Promotion: before a request reaches the engine, load the prefix blocks a lower tier
holds when that is cheaper than recomputing them.

NOTE: the cost model compares two measured rates::

    load_s      = rpc_overhead_s + num_blocks * block_bytes / transfer_bytes_per_s
    recompute_s = num_blocks * block_size / prefill_tokens_per_s

Both rates are exponentially weighted means of what this executor observed (each
promotion's bytes over its whole wall time: lookup, fetch and import, so per-call
overheads are priced in; each request's computed prompt tokens over its time from
submission to first token), seeded with conservative defaults. Loading happens only for the run of blocks
right after the local (GPU) hits: a hash chain cannot skip a block.

Everything here runs on the event loop; engine state is changed only through
``AsyncEngine.call`` (between steps), so a step never waits on the network. The one read
before the lookup (how many prompt blocks are already local) is an ``AsyncEngine.peek``:
waiting for the step in progress to end would add up to a whole step to every request's
time to first token, and a count one step stale only shifts which blocks are looked up.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from services.shared.block_hash import extra_keys_for, hash_block_chain
from services.shared.vocabulary import DEFAULT_PARTITION
from services.executor.tiers.kv_transfer import KvTransfer
from services.executor.tiers.tier_client import TierClient
from services.mesh import metrics

log = structlog.get_logger(__name__)

PROMOTION_SECONDS = metrics.histogram(
    "weft_executor_promotion_seconds", "Wall time to fetch and import promoted blocks.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
PROMOTED_BLOCKS = metrics.counter("weft_executor_promoted_blocks_total", "Blocks loaded from the cachestore.")
PROMOTION_DECISIONS = metrics.counter("weft_executor_promotion_decisions_total",
                                      "Prefix misses the cachestore could serve, by decision.", ["decision"])


@dataclass
class CostModel:
    """Load-vs-recompute decision from measured rates (mutated by ``observe_*``)."""

    transfer_bytes_per_s: float = 200e6
    prefill_tokens_per_s: float = 2000.0
    rpc_overhead_s: float = 0.001  # the Contains round trip; the rest is in the measured rate
    alpha: float = 0.3  # weight of a new observation (the first one replaces the seed)
    num_transfers: int = 0
    num_prefills: int = 0

    def load_s(self, num_blocks: int, block_bytes: int) -> float:
        return self.rpc_overhead_s + num_blocks * block_bytes / self.transfer_bytes_per_s

    def recompute_s(self, num_blocks: int, block_size: int) -> float:
        return num_blocks * block_size / self.prefill_tokens_per_s

    def should_load(self, num_blocks: int, block_bytes: int, block_size: int) -> bool:
        return num_blocks > 0 and self.load_s(num_blocks, block_bytes) < self.recompute_s(num_blocks, block_size)

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            a = self.alpha if self.num_transfers else 1.0
            self.transfer_bytes_per_s += a * (num_bytes / seconds - self.transfer_bytes_per_s)
            self.num_transfers += 1

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= 16 and seconds > 0:  # tiny prefills measure overhead, not throughput
            a = self.alpha if self.num_prefills else 1.0
            self.prefill_tokens_per_s += a * (num_tokens / seconds - self.prefill_tokens_per_s)
            self.num_prefills += 1


@dataclass(frozen=True)
class PromotionResult:
    num_local_blocks: int
    num_available_blocks: int  # after the local ones, held by the cachestore
    num_promoted_blocks: int
    promoted_bytes: int
    load_s: float
    skipped_by_cost_model: bool


class Promoter:
    def __init__(self, transfer: KvTransfer, client: TierClient, model_id: str, block_size: int,
                 cost: CostModel | None = None) -> None:
        self.transfer = transfer
        self.client = client
        self.model_id = model_id
        self.block_size = block_size
        self.cost = cost or CostModel()
        self._block_bytes: int | None = None

    def prompt_hashes(self, token_ids: list[int], tenant_salt: str) -> list[int]:
        """Hashes of the blocks a prefix hit may cover (never the last prompt token)."""
        usable = (len(token_ids) - 1) // self.block_size * self.block_size
        return hash_block_chain(token_ids[:usable], self.block_size, extra_keys_for(self.model_id, tenant_salt))

    async def block_bytes(self) -> int:
        if self._block_bytes is None:
            dtype, shape = await self.transfer.layout()
            itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
            n = 1
            for d in shape:
                n *= d
            self._block_bytes = n * itemsize
        return self._block_bytes

    async def promote(self, token_ids: list[int], tenant_salt: str = "", partition: str = DEFAULT_PARTITION,
                      force: bool = False) -> PromotionResult:
        """Make the prompt's leading blocks resident when the cost model (or ``force``)
        says so. Never raises on a cachestore problem: that is a miss (recompute)."""
        start = time.perf_counter()
        hashes = self.prompt_hashes(token_ids, tenant_salt)
        if not hashes:
            return PromotionResult(0, 0, 0, 0, 0.0, False)
        num_local = self.transfer.engine.peek(lambda e: len(e.pool.get_cached_blocks(hashes)))
        rest = hashes[num_local:]
        if not rest:  # every block is local: nothing to ask the store
            return PromotionResult(num_local, 0, 0, 0, 0.0, False)
        try:
            tiers = await self.client.contains(rest)
        except Exception as exc:  # noqa: BLE001 - a store problem is a miss, never a failed request
            log.warning("promotion_lookup_failed", error=str(exc))
            return PromotionResult(num_local, 0, 0, 0, 0.0, False)
        num_avail = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        if num_avail == 0:
            return PromotionResult(num_local, 0, 0, 0, 0.0, False)
        block_bytes = await self.block_bytes()
        if not force and not self.cost.should_load(num_avail, block_bytes, self.block_size):
            PROMOTION_DECISIONS.labels("recompute").inc()
            return PromotionResult(num_local, num_avail, 0, 0, 0.0, True)
        PROMOTION_DECISIONS.labels("load").inc()
        try:
            payloads = await self.client.get_blocks(rest[:num_avail])
        except Exception as exc:  # noqa: BLE001
            log.warning("promotion_fetch_failed", error=str(exc))
            return PromotionResult(num_local, num_avail, 0, 0, 0.0, False)
        parent = hashes[num_local - 1] if num_local else None
        result = await self.transfer.import_(payloads, parent, partition, hold_hashes=hashes[:num_local])
        elapsed = time.perf_counter() - start
        nbytes = sum(p.size_bytes for p in payloads[:result.num_imported + result.num_present])
        self.cost.observe_transfer(nbytes, elapsed)
        PROMOTION_SECONDS.observe(elapsed)
        PROMOTED_BLOCKS.inc(result.num_imported)
        log.info("blocks_promoted", num_local=num_local, num_available=num_avail, num_promoted=result.num_imported,
                 load_ms=round(elapsed * 1000, 2))
        return PromotionResult(num_local, num_avail, result.num_imported, nbytes, elapsed, False)
