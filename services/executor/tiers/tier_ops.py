"""What the executor service does with the cachestore around a request's life.

* ``before_submit``: promote the prompt's missing prefix blocks (cost model decides);
* ``observe``: each step output; the first one measures the prefill rate the cost
  model compares against; the last one triggers demote-on-finish for the request's
  whole token sequence (prompt + output), in the background, while the pool is under
  pressure (``finish_min_held``: below it LRU keeps the blocks anyway, and on a CPU the
  write competes with the steps; one agent-benchmark run had program p99 15 % shorter
  without it on every seed, a rerun against this gate mixed (0.67, 1.05, 1.13): not
  separable from that box's noise);
* ``demote`` / ``promote``: the explicit ``DemoteBlocks`` / ``PromoteBlocks`` RPCs.

A cachestore that is down or full never fails a request: promotion degrades to
recompute, demotion to "not written" (logged).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from services.executor.tiers.offload import DemoteOnFinish, Demoter
from services.executor.engine.engine import StepOutput
from services.executor.tiers.promotion import Promoter
from services.mesh import metrics
from services.shared.vocabulary import partition_of

log = structlog.get_logger(__name__)

# a finished request the demote-on-finish setting covers: written to the cachestore, or
# skipped because the pool had room (--demote-on-finish-min-held)
FINISH_DEMOTIONS = metrics.counter("weft_executor_finish_demotions_total",
                                   "Finished requests demote-on-finish covered, by outcome (written, skipped).",
                                   ["outcome"])


@dataclass
class _Tracked:
    token_ids: list[int]
    tenant_salt: str
    has_session: bool
    priority: float
    expected_pause_ms: int
    submitted_s: float
    first_token_seen: bool = False
    outputs: list[int] = field(default_factory=list)


class TierOps:
    def __init__(self, promoter: Promoter, demoter: Demoter, demote_on_finish: DemoteOnFinish,
                 promote_before_prefill: bool = True, finish_min_held: float = 0.0,
                 pool_held: Callable[[], float] = lambda: 1.0) -> None:
        """``finish_min_held``: demote-on-finish writes only while ``pool_held()`` (the
        fraction of the KV pool running requests hold) is at least this; 0: always."""
        self.promoter = promoter
        self.demoter = demoter
        self.demote_on_finish = demote_on_finish
        self.finish_min_held = finish_min_held
        self.pool_held = pool_held
        self.num_finish_demotions_skipped = 0  # finished requests not written: the pool had room
        self.promote_before_prefill = promote_before_prefill
        self.force_promotion = False  # load whatever the cost model says (benchmarks, tests)
        self._tracked: dict[str, _Tracked] = {}  # insertion order = oldest first
        self.max_tracked = 4096
        self._background: set[asyncio.Task] = set()

    async def before_submit(self, request) -> None:
        """``request``: an ExecuteRequest. Never raises for a cachestore problem."""
        prompt = list(request.prompt_token_ids)
        while len(self._tracked) >= self.max_tracked:  # backstop: the stream forgets its request at its end
            self._tracked.pop(next(iter(self._tracked)))
        session = request.session if request.HasField("session") else None
        self._tracked[request.request_id] = _Tracked(
            prompt, request.tenant_salt, bool(session and session.session_id), request.priority,
            session.expected_tool_ms if session else 0, time.perf_counter())
        if self.promote_before_prefill:
            try:
                await self.promoter.promote(prompt, request.tenant_salt,
                                            partition_of(request.partition, request.tenant_salt),
                                            force=self.force_promotion)
            except Exception as exc:  # noqa: BLE001 - recompute instead
                log.warning("promotion_failed", request_id=request.request_id, error=str(exc))
            tracked = self._tracked.get(request.request_id)
            if tracked is not None:  # the prefill clock starts when the engine gets the request
                tracked.submitted_s = time.perf_counter()

    def observe(self, request_id: str, out: StepOutput) -> None:
        t = self._tracked.get(request_id)
        if t is None:
            return
        t.outputs.extend(out.new_token_ids)
        if not t.first_token_seen and out.new_token_ids:
            t.first_token_seen = True
            self.promoter.cost.observe_prefill(out.num_prompt_tokens - out.num_cached_tokens,
                                               time.perf_counter() - t.submitted_s)
        if out.finished:
            self._tracked.pop(request_id, None)
            if not (self.demote_on_finish is DemoteOnFinish.ALL or (
                    self.demote_on_finish is DemoteOnFinish.SESSIONS and t.has_session)):
                return
            if self.finish_min_held > 0 and self.pool_held() < self.finish_min_held:
                self.num_finish_demotions_skipped += 1
                FINISH_DEMOTIONS.labels("skipped").inc()
                return
            FINISH_DEMOTIONS.labels("written").inc()
            task = asyncio.get_running_loop().create_task(self._demote_quietly(t), name=f"demote-{request_id}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def forget(self, request_id: str) -> None:
        """Drop a request that ended without a finished output (cancelled, failed)."""
        self._tracked.pop(request_id, None)

    async def _demote_quietly(self, t: _Tracked) -> None:
        try:
            await self.demoter.demote(token_ids=t.token_ids + t.outputs, tenant_salt=t.tenant_salt,
                                      priority=t.priority, expected_pause_ms=t.expected_pause_ms)
        except Exception as exc:  # noqa: BLE001 - the blocks simply stay GPU-only
            log.warning("demote_on_finish_failed", error=str(exc))

    async def drain(self) -> None:
        """Wait for background demotions (tests, shutdown)."""
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


def build_tier_ops(async_engine, cachestore_address: str, model_id: str, block_size: int,
                   demote_on_finish: str = "sessions", promote_before_prefill: bool = True,
                   finish_min_held: float = 0.0) -> TierOps:
    from services.executor.tiers.kv_transfer import KvTransfer
    from services.executor.tiers.tier_client import TierClient

    client = TierClient(cachestore_address, model_id=model_id, block_size=block_size)
    transfer = KvTransfer(async_engine)
    return TierOps(Promoter(transfer, client, model_id, block_size), Demoter(transfer, client, model_id, block_size),
                   DemoteOnFinish(demote_on_finish), promote_before_prefill, finish_min_held,
                   lambda: async_engine.peek(_held_fraction))


def _held_fraction(engine) -> float:
    """The fraction of the KV pool running requests hold: free and cached-free blocks are
    room, and so are pinned ones (an idle paused session's pin yields to live work, so
    pins alone never push a finished hop's blocks out). Read by ``AsyncEngine.peek``, one
    step stale at most; a block both pinned and in use counts once as room (a heuristic)."""
    pool = engine.pool
    pins = getattr(engine, "pins", None)
    pinned = pins.num_pinned_blocks if pins is not None else 0
    return max(0.0, 1.0 - (pool.num_free_blocks + pinned) / max(1, pool.num_blocks))
