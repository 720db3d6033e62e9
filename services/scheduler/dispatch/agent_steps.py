"""The agent plane on the request path: agent_plane.py's decisions, applied per job.

    begin(job)            validate session / hop / contract; the hop's plan (its full
                          prompt when stateful, class, priority) and contract fallback
    place(plan, …)        reroute, pause decision, the priority the executor is told,
                          stale-KV release and promotion of demoted blocks
    observe(plan, chunk)  stamp class / fallback / pause on the stream; record the hop
                          when it ends (and demote its KV when the pause policy said so)
    reprioritize_forever  push re-estimated priorities of running hops to executors

Priority is higher-runs-first everywhere here (services/shared/vocabulary.py): the plan's
priority goes to the executor unchanged; only admission, an ascending queue, is handed
``queue_order_key`` of it. Owns the table of live plans; nothing outside reads it.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from services.mesh import metric_catalogue as catalogue
from services.scheduler.agent_plane import AgentPlane, HopPlan
from services.scheduler.dispatch.job import Chunk, ExecutorCallError, ExecutorPort, Job
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.contracts import Fallback
from services.scheduler.policy.pause import PauseDecision
from services.scheduler.policy.placement import InflightTracker, Placement
from services.scheduler.state.membership import ExecutorLoad, ExecutorRecord, Membership
from services.scheduler.state.sessions import SessionState, executor_session_id
from services.shared.block_hash import extra_keys_for, hash_block_chain
from services.shared.vocabulary import queue_order_key

log = structlog.get_logger(__name__)


class AgentSteps:
    def __init__(self, plane: AgentPlane, membership: Membership, port: ExecutorPort, admission: Admission,
                 inflight: InflightTracker) -> None:
        self.plane = plane
        self.membership = membership
        self.port = port
        self.admission = admission
        self.inflight = inflight  # the dispatcher's: what this scheduler streams on each executor
        self._plans: dict[str, HopPlan] = {}  # request id -> plan of a live hop

    # -- before admission -------------------------------------------------------------
    def begin(self, job: Job) -> HopPlan:
        """Plan ``job``'s hop; raises InvalidScheduleRequest naming the field, or
        OverloadedError for a FAIL_FAST contract that cannot be met. Until ``end``, the
        plan is live (its priority is re-pushed to the executor)."""
        pool = max((r.num_blocks for r in self.membership.placeable(job.model_id)), default=0)
        plan = self.plane.begin(job.hop, pool)
        a = self.admission
        ahead = a.num_ahead(queue_order_key(plan.priority(a.clock()))) + (1 if a.num_in_flight >= a.max_in_flight
                                                                           else 0)
        # FAIL_FAST raises OverloadedError; DEGRADE may use a rung a live executor pool serves.
        self.plane.fallback(plan, ahead, a.max_in_flight, self.membership.offered_rungs(job.model_id))
        self._plans[job.request_id] = plan
        return plan

    def order_key(self, plan: HopPlan) -> Callable[[float], float]:
        """The ascending admission-queue key of ``plan`` as a function of now."""
        return lambda now: queue_order_key(plan.priority(now))

    def end(self, request_id: str) -> None:
        self._plans.pop(request_id, None)

    # -- at placement -----------------------------------------------------------------
    async def place(self, plan: HopPlan, job: Job, prompt: list[int], ranked: list[Placement]) -> list[Placement]:
        """Reroute, pause decision, stale-KV release and promotion for one placed hop;
        sets ``job.priority`` to the plan's (the executor orders its queue by it)."""
        if plan.fallback.path is Fallback.REROUTE and len(ranked) > 1:
            def active(p: Placement) -> int:
                rec = self.membership.get(p.name)
                load = rec.load if rec and rec.load else ExecutorLoad()
                return max(load.num_running + load.num_waiting, self.inflight.num_requests(p.name))
            ranked = sorted(ranked, key=active)
        top = ranked[0]
        rec = self.membership.get(top.name)
        load = (rec.load if rec else None) or ExecutorLoad()
        total = (rec.num_blocks if rec else 0) or load.num_blocks
        pause = self.plane.pause(plan, top.name, max(0, load.num_blocks - load.num_free_blocks), total)
        if pause.decision.value != "none":
            catalogue.count_pause(pause.decision.value)
        job.priority = plan.priority(self.admission.clock())
        if plan.release is not None:
            await self._release_stale(plan, job.tenant)
        if plan.resumes_demoted and rec is not None:
            await self._promote(rec, job.tenant, prompt)
        return ranked

    @staticmethod
    def exec_fields(plan: HopPlan) -> dict:
        """What the executor is told of the hop's pause: a pin's TTL, the KV quota."""
        return {"pin_ttl_ms": plan.pause.pin_ttl_ms, "kv_quota_blocks": plan.request.terms.kv_quota_blocks}

    async def reprioritize_forever(self, period_s: float = 0.5) -> None:
        """Every scheduling interval, re-estimate the priority of the requests already on
        executors and push it (one UpdatePriorities per executor): a long program's
        running hop sinks as its program's attained service grows, a deadline rises."""
        while True:
            await asyncio.sleep(period_s)
            now = self.admission.clock()
            by_executor: dict[str, list[tuple[str, float]]] = {}
            for rid, plan in list(self._plans.items()):
                if plan.executor:
                    by_executor.setdefault(plan.executor, []).append((rid, plan.priority(now)))
            for name, items in by_executor.items():
                rec = self.membership.get(name)
                if rec is None:
                    continue
                try:
                    await self.port.update_priorities(rec.address, [r for r, _ in items], [p for _, p in items])
                except ExecutorCallError as exc:
                    log.debug("priority_update_failed", executor=name, code=exc.code)

    # -- while it streams -------------------------------------------------------------
    def observe(self, plan: HopPlan, chunk: Chunk, t0: float) -> None:
        """Stamp the class / fallback / pause on the stream; record the hop when it ends."""
        if plan.num_chunks == 0:
            chunk.request_class = plan.request_class
            chunk.fallback = plan.fallback
            plan.num_cached_tokens = chunk.num_cached_tokens
            plan.executor = chunk.executor
        plan.num_chunks += 1
        plan.output_token_ids.extend(chunk.token_ids)
        if not chunk.finished:
            return
        chunk.pause = plan.pause.decision
        ses = self.plane.finish(plan, chunk.executor, plan.output_token_ids, plan.num_cached_tokens,
                                chunk.mean_entropy,
                                (time.monotonic() - t0) * 1000.0)
        if ses is not None and plan.pause.decision is not PauseDecision.NONE:
            log.info("session_paused", session_id=ses.session_id, decision=plan.pause.decision.value,
                     pin_ttl_ms=plan.pause.pin_ttl_ms, executor=chunk.executor, reason=plan.pause.reason)
        if ses is not None and plan.pause.decision is PauseDecision.DEMOTE:
            rec = self.membership.get(chunk.executor)
            if rec is not None:
                asyncio.get_running_loop().create_task(self._demote(rec, ses, plan))

    # -- executor calls ---------------------------------------------------------------
    async def _release_stale(self, plan: HopPlan, tenant: str) -> None:
        rel = plan.release
        rec = self.membership.get(rel.executor)
        if rec is None:
            return
        keys = extra_keys_for(rec.model_id, tenant, rec.kv_cache_dtype)
        old = hash_block_chain(list(rel.stale_context_token_ids), rec.block_size, keys)
        keep = set(hash_block_chain(list(rel.new_prompt_token_ids), rec.block_size, keys))
        try:
            await self.port.release_session(rec.address, executor_session_id(tenant, rel.session_id),
                                            [h for h in old if h not in keep])
        except ExecutorCallError as exc:
            log.warning("session_release_failed", executor=rec.name, details=exc.details)

    async def _demote(self, rec: ExecutorRecord, ses: SessionState, plan: HopPlan) -> None:
        try:
            await self.port.demote_blocks(rec.address, ses.context_token_ids.tolist(), ses.tenant,
                                          plan.priority(time.monotonic()), plan.request.expected_tool_ms)
        except ExecutorCallError as exc:
            no_tier = exc.code == "INVALID_ARGUMENT" and "cachestore" in exc.details
            if exc.code == "UNIMPLEMENTED" or no_tier:
                self.plane.demote_unavailable(ses)
            else:
                log.warning("session_demote_failed", executor=rec.name, details=exc.details)
                ses.demoted = False
            return
        expected_s = (plan.request.expected_tool_ms or ses.observed_pause_ms) / 1000.0
        if expected_s > 0:  # prefetch: promote shortly before the tool is expected back
            await asyncio.sleep(0.8 * expected_s)
            if ses.demoted and ses.pause_started_s is not None:
                await self._promote(rec, ses.tenant, ses.context_token_ids.tolist())

    async def _promote(self, rec: ExecutorRecord, tenant: str, token_ids: list[int]) -> None:
        try:
            await self.port.promote_blocks(rec.address, token_ids, tenant)
        except ExecutorCallError as exc:
            log.info("session_promote_skipped", executor=rec.name, code=exc.code)
