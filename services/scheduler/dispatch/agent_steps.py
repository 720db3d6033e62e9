"""The agent plane on the request path: agent_plane.py's decisions, applied per job.

    begin(job)            validate session / hop / contract; the hop's plan (its full
                          prompt when stateful, class, priority) and contract fallback
    place(plan, …)        reroute, pause decision, the priority the executor is told,
                          stale-KV release and promotion of demoted blocks
    observe(plan, chunk)  stamp class / fallback / pause on the stream; record the hop
                          when it ends (and demote its KV when the pause policy said so)
    reprioritize_forever  push re-estimated priorities of running hops to executors
    end_session(…)        release a session's pins on every executor and forget it
    fork_session(…)       children that copy a session's context (its KV shared by reference)
    join_session(…)       a parent continues from a child's context; the other children end

One hop of a session runs at a time: ``begin`` claims the session (a second hop is
refused with SessionBusyError) and the claim ends with the hop's last chunk, so the next
hop may follow the instant the client has the previous answer.

Priority is higher-runs-first everywhere here (services/shared/vocabulary.py): the plan's
priority goes to the executor unchanged; only admission, an ascending queue, is handed
``queue_order_key`` of it. Owns the table of live plans; nothing outside reads it.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from services.mesh import metric_catalogue as catalogue
from services.scheduler.agent_plane import AgentPlane, HopPlan
from services.scheduler.dispatch.job import Chunk, ExecutorCallError, ExecutorPort, Job
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.contracts import Fallback
from services.scheduler.policy.pause import PauseDecision
from services.scheduler.policy.placement import InflightTracker, Placement
from services.scheduler.state.membership import ExecutorLoad, ExecutorRecord, Membership
from dataclasses import dataclass

from services.scheduler.state.sessions import Forked, Joined, SessionState, executor_session_id
from services.shared.block_hash import extra_keys_for, hash_block_chain
from services.shared.vocabulary import queue_order_key

if TYPE_CHECKING:
    from services.scheduler.policy.intent_shift import IntentShiftDecision

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SessionEnd:
    """What ending a session did (None from ``end_session``: the tenant has no such session)."""

    ended_now: bool  # False: it had already been ended (idempotent)
    num_executors_released: int
    num_running_hops: int


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
    def begin(self, job: Job, cached_tokens: Callable[[list[int]], int] | None = None) -> HopPlan:
        """Plan ``job``'s hop; raises InvalidScheduleRequest naming the field, or
        OverloadedError for a FAIL_FAST contract that cannot be met. ``cached_tokens``:
        the longest prefix of a prompt an executor holds, so a contract's TTFT estimate
        prices only the prefill left to do (asked only when the hop has a TTFT ceiling).
        Until ``end``, the plan is live (its priority is re-pushed to the executor)."""
        hop = job.hop
        sessions = self.plane.sessions
        sessions.claim(hop.tenant, hop.session_id, job.request_id)  # SessionBusyError: one hop at a time
        try:
            pool = max((r.num_blocks for r in self.membership.placeable(job.model_id)), default=0)
            plan = self.plane.begin(hop, pool)
            a = self.admission
            ahead = a.num_ahead(queue_order_key(plan.priority(a.clock()))) + (
                1 if a.num_in_flight >= a.max_in_flight else 0)
            # FAIL_FAST raises OverloadedError; DEGRADE may use a rung a live executor pool serves.
            cached = (cached_tokens(plan.prompt_token_ids)
                      if cached_tokens is not None and hop.terms.ttft_ceiling_ms else 0)
            self.plane.fallback(plan, ahead, a.max_in_flight, self.membership.offered_rungs(job.model_id), cached)
        except BaseException:
            sessions.release_claim(hop.tenant, hop.session_id, job.request_id)
            raise
        self._plans[job.request_id] = plan
        return plan

    def order_key(self, plan: HopPlan) -> Callable[[float], float]:
        """The ascending admission-queue key of ``plan`` as a function of now."""
        return lambda now: queue_order_key(plan.priority(now))

    def end(self, request_id: str) -> None:
        """The job left the path (finished, failed, cancelled): its plan and claim go."""
        plan = self._plans.pop(request_id, None)
        if plan is not None:
            self.plane.sessions.release_claim(plan.request.tenant, plan.request.session_id, request_id)

    async def end_session(self, tenant: str, session_id: str, fork_id: str = "") -> SessionEnd | None:
        """End ``tenant``'s session now: forget its context and pin accounting, and ask
        every known executor to release its pins (pins are keyed by the tenant-scoped id,
        so no other tenant's blocks can be touched). A hop still running is left to finish;
        its KV is released when it does (``observe``). None when this tenant never had the
        session (another tenant's id included); a repeated end is a no-op that succeeds.
        With ``fork_id``, only a session that fork created ends (``SessionTable.created_by``);
        any other is left as it is (not ended now, nothing released)."""
        sessions = self.plane.sessions
        if fork_id and not sessions.created_by(tenant, session_id, fork_id):
            return SessionEnd(False, 0, 0)
        already = sessions.was_ended(tenant, session_id)
        running = any(p.request.tenant == tenant and p.request.session_id == session_id
                      for p in self._plans.values())
        ses = sessions.end(tenant, session_id, running)
        num_running = self._ended(tenant, session_id, ses)
        if ses is None and not num_running and not already:
            return None
        released = await self._release_everywhere(tenant, session_id)
        if ses is not None:  # the children it joined from pinned its context under their own ids
            await asyncio.gather(*(self._release_everywhere(tenant, a) for a in sessions.absorbed_pins(ses)))
        log.info("session_ended", session_id=session_id, num_executors_released=released,
                 num_running_hops=num_running, ended_now=not already)
        return SessionEnd(not already, released, num_running)

    def _ended(self, tenant: str, session_id: str, ses: SessionState | None) -> int:
        """The session was just ended in the table: stop its prefetch, mark its running hops
        (released again after they finish, ``observe``) and forget its pin accounting;
        returns how many hops run. Synchronous, so no hop slips in before the release."""
        if ses is not None:
            ses.demoted = False  # a pending prefetch promotion must not bring it back
            ses.pause_started_s = None
        running = [p for p in self._plans.values()
                   if p.request.tenant == tenant and p.request.session_id == session_id]
        for plan in running:
            plan.session_ended = True
        self.plane.forget_pins(tenant, session_id)
        return len(running)

    def fork_session(self, tenant: str, session_id: str, child_ids: list[str],
                     or_new: tuple[str, int] | None = None, fork_id: str = "") -> Forked:
        """Fork ``tenant``'s idle session into ``child_ids`` (SessionTable.fork raises the
        refusals). Nothing reaches an executor: each child's first stateful hop sends the
        parent's context + its new tokens, placement by KV overlap picks the executor that
        holds the parent's blocks and its prefix cache serves them by reference (one copy
        of the blocks however many children). The parent's pins are left alone.
        ``or_new`` = (program id, next hop): with no context to fork, the children are
        created as new sessions (SessionTable.fork_or_new) instead of NOT_FOUND. Each child
        records ``fork_id``, so ``end_session`` with it ends only what this fork created."""
        table = self.plane.sessions
        forked = (table.fork(tenant, session_id, child_ids, fork_id) if or_new is None
                  else table.fork_or_new(tenant, session_id, child_ids, *or_new, fork_id=fork_id))
        parent = forked.parent
        log.info("session_forked", session_id=session_id, child_session_ids=list(child_ids),
                 num_context_tokens=len(parent.context_token_ids) if parent else 0,
                 executor=parent.executor if parent else "", new_sessions=parent is None)
        return forked

    async def join_session(self, tenant: str, session_id: str, from_id: str, end_children: bool) -> Joined:
        """Join ``tenant``'s session: it continues from child ``from_id`` (or its own
        context); with ``end_children`` its other children end as ``end_session`` ends a
        session (pins released on every executor, running hops left to finish). The pins of
        the children it had joined from before are released too (``Joined.superseded``: the
        absorbed child's pins hold the whole context now), unless a live session holds the id."""
        table = self.plane.sessions
        joined = table.join(tenant, session_id, from_id, end_children)
        if joined.absorbed is not None:  # its pins stay (the parent's next hop reads them) until their TTL
            joined.absorbed.pause_started_s = None
        for child in joined.ended:
            self._ended(tenant, child.session_id, child)
        ended = [*joined.ended_ids, *(a for child in joined.ended for a in table.absorbed_pins(child)),
                 *(a for a in joined.superseded if table.get(tenant, a) is None and table.running_hop(tenant, a) is None)]
        await asyncio.gather(*(self._release_everywhere(tenant, cid) for cid in ended))
        log.info("session_joined", session_id=session_id, from_session_id=from_id,
                 ended_session_ids=list(joined.ended_ids), num_context_tokens=len(joined.parent.context_token_ids))
        return joined

    async def _release_everywhere(self, tenant: str, session_id: str) -> int:
        records = self.membership.all()
        sid = executor_session_id(tenant, session_id)

        async def release(rec: ExecutorRecord) -> bool:
            try:
                await self.port.release_session(rec.address, sid, [])
                return True
            except ExecutorCallError as exc:
                log.warning("session_release_failed", executor=rec.name, details=exc.details)
                return False
        return sum(await asyncio.gather(*(release(r) for r in records)))

    # -- at placement -----------------------------------------------------------------
    async def place(self, plan: HopPlan, job: Job, prompt: list[int], ranked: list[Placement]) -> list[Placement]:
        """Reroute, pause decision, stale-KV release and promotion for one placed hop;
        sets ``job.priority`` to the plan's (the executor orders its queue by it) and
        records the hop's decisions in ``job.decisions`` (the relay reports them)."""
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
        self._record_decisions(plan, job, len(prompt), top, rec.block_size if rec else 16)
        if plan.release is not None:
            await self._release_stale(plan, job.tenant)
        if plan.resumes_demoted and rec is not None:
            await self._promote(rec, job.tenant, prompt)
        return ranked

    def _record_decisions(self, plan: HopPlan, job: Job, num_prompt_tokens: int, top: Placement,
                          block_size: int) -> None:
        """The plan's decisions into ``job.decisions``; the TTFT estimate counts the
        chosen executor's expected prefix overlap as cached."""
        d = job.decisions
        d.request_class, d.priority, d.fallback = plan.request_class, job.priority, plan.fallback
        d.ttft_ceiling_ms = plan.request.terms.ttft_ceiling_ms
        d.expected_cached_tokens = min(num_prompt_tokens, top.num_matched_blocks * block_size)
        d.ttft_estimate_ms = round(self.plane.contracts.estimate_with_cached(
            plan.fallback, num_prompt_tokens, d.expected_cached_tokens, self.plane.prefill_ms_per_token(top.name)))
        d.pause, d.pause_reason, d.pin_ttl_ms = plan.pause.decision, plan.pause.reason, plan.pause.pin_ttl_ms
        if plan.intent is not None:  # the hop's intent was checked
            d.intent_checked, d.intent_shift = True, plan.intent.shifted
            d.intent_distance, d.intent_signal = plan.intent.distance, plan.intent.signal

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
        r = plan.request
        ses = self.plane.finish(plan, chunk.executor, plan.output_token_ids, plan.num_cached_tokens,
                                chunk.mean_entropy,
                                (time.monotonic() - t0) * 1000.0)
        self.plane.sessions.release_claim(r.tenant, r.session_id, r.request_id)  # the next hop may come
        if plan.session_ended:  # ended while this hop ran: forget what it recorded, free what it pinned
            self.plane.sessions.end(r.tenant, r.session_id)
            self.plane.forget_pins(r.tenant, r.session_id)
            asyncio.get_running_loop().create_task(self._release_everywhere(r.tenant, r.session_id))
            return
        if ses is not None and plan.pause.decision is not PauseDecision.NONE:
            log.info("session_paused", session_id=ses.session_id, decision=plan.pause.decision.value,
                     pin_ttl_ms=plan.pause.pin_ttl_ms, executor=chunk.executor, reason=plan.pause.reason)
        if ses is not None and plan.pause.decision is PauseDecision.DEMOTE:
            rec = self.membership.get(chunk.executor)
            if rec is not None:
                asyncio.get_running_loop().create_task(self._demote(rec, ses, plan))

    # -- the intent check, awaited before ``begin`` -------------------------------------
    async def judge_intent(self, job: Job) -> IntentShiftDecision | None:
        """Judge whether ``job``'s hop turns away from its session's kept or demoted
        context, awaiting the embedding signal for at most the plane's ``intent_timeout_s``
        (past it, or with the cachestore down, the bigram fallback decides and
        ``fallback_reason`` says why). The verdict rides on ``job.hop`` into ``begin``.
        None: nothing to judge (no agent hop, hop 0, no session context, KV dropped).
        Modifies only ``job.hop``."""
        if job.hop is None:
            return None
        inputs = self.plane.intent_inputs(job.hop)
        if inputs is None:
            return None
        context, turn = inputs
        decision = await self.plane.intent.decide_async(context, turn, self.plane.intent_timeout_s)
        job.hop = job.hop.judged(decision, len(context))
        return decision

    # -- executor calls ---------------------------------------------------------------
    async def _release_stale(self, plan: HopPlan, tenant: str) -> None:
        """Released KV goes down, never back up: the executor unpins the session and
        forgets the stale blocks (the old context's blocks the new prompt does not reuse),
        and the cachestore moves its copies of them (written back when the hop finished,
        or demoted for the pause) to its archive tier, in the background. Nothing promotes
        them again for this session (``begin`` cleared its demoted state); a later prompt
        that does reuse them still reads them back. Failures are logged, not raised."""
        rel = plan.release
        rec = self.membership.get(rel.executor)
        if rec is None:
            return
        keys = extra_keys_for(rec.model_id, tenant, rec.kv_cache_dtype)
        old = hash_block_chain(list(rel.stale_context_token_ids), rec.block_size, keys)
        keep = set(hash_block_chain(list(rel.new_prompt_token_ids), rec.block_size, keys))
        stale = [h for h in old if h not in keep]
        try:
            await self.port.release_session(rec.address, executor_session_id(tenant, rel.session_id), stale)
        except ExecutorCallError as exc:
            log.warning("session_release_failed", executor=rec.name, details=exc.details)
        archive = self.plane.kv_archive
        if stale and archive is not None:
            async def archive_stale() -> None:
                try:
                    n = await archive.archive_blocks(stale)
                    log.info("stale_kv_archived", session_id=rel.session_id, num_stale_blocks=len(stale),
                             num_archived_blocks=n)
                except Exception as exc:  # any cachestore failure: the blocks age out of its RAM by LRU
                    log.warning("stale_kv_archive_failed", session_id=rel.session_id,
                                error=str(exc) or type(exc).__name__)
            asyncio.get_running_loop().create_task(archive_stale())

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
            last_hop = ses.last_hop
            await asyncio.sleep(0.8 * expected_s)
            # Still this pause's demoted blocks: not resumed, not released by an intent shift
            # (begin clears ``demoted``), not replaced by a later hop's context.
            if ses.demoted and ses.pause_started_s is not None and ses.last_hop == last_hop:
                await self._promote(rec, ses.tenant, ses.context_token_ids.tolist())

    async def _promote(self, rec: ExecutorRecord, tenant: str, token_ids: list[int]) -> None:
        try:
            await self.port.promote_blocks(rec.address, token_ids, tenant)
        except ExecutorCallError as exc:
            log.info("session_promote_skipped", executor=rec.name, code=exc.code)
