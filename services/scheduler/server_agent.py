"""Agent-native serving hooks of the Scheduler servicer: protos in, agent_plane.py's
domain decisions out (sessions, priorities, contracts, pauses, demote / promote)."""
from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from services.mesh import metric_catalogue as catalogue
from services.scheduler.agent_plane import HopPlan, HopRequest
from services.scheduler.policy.contracts import ContractTerms, Fallback
from services.scheduler.policy.pause import PauseDecision
from services.scheduler.policy.placement import Placement
from services.scheduler.policy.priority import RequestClassName
from services.scheduler.server_degrade import degradation_contract
from services.scheduler.state.sessions import executor_session_id
from services.shared.block_hash import extra_keys_for, hash_block_chain
from services.scheduler.state.membership import ExecutorLoad, ExecutorRecord
from weft.v1 import common_pb2 as common_v1, executor_pb2, scheduler_pb2

log = structlog.get_logger(__name__)


class AgentHooks:
    """Mixed into SchedulerServicer; uses its ``agent``, ``view``, ``channels``,
    ``admission`` and ``inflight`` attributes."""

    # -- agent-native serving (agent_plane.py): protos in, domain decisions out ------
    def _agent_begin(self, request: scheduler_pb2.ScheduleRequest) -> HopPlan | None:
        if self.agent is None:
            return None
        ses, c = request.session, request.session.contract
        hop = HopRequest(
            request_id=request.request_id, tenant=request.tenant, prompt_token_ids=list(request.prompt_token_ids),
            session_id=ses.session_id, program_id=ses.program_id, hop_index=ses.hop_index,
            expected_tool_ms=ses.expected_tool_ms, stateful=ses.stateful,
            request_class=_CLASS_FROM_PB.get(ses.request_class),
            terms=ContractTerms(c.kv_quota_blocks, c.ttft_ceiling_ms, c.tpot_ceiling_ms,
                                _FALLBACK_FROM_PB.get(c.fallback, Fallback.NONE), degradation_contract(c)),
            caller_priority=request.priority,
        )
        pool = max((r.num_blocks for r in self.view.membership.placeable(request.model_id)), default=0)
        plan = self.agent.begin(hop, pool)
        a = self.admission
        ahead = a.num_ahead(plan.score(a.clock())) + (1 if a.num_in_flight >= a.max_in_flight else 0)
        # FAIL_FAST raises OverloadedError; DEGRADE may use a rung a live executor pool serves.
        self.agent.fallback(plan, ahead, a.max_in_flight, self.view.membership.offered_rungs(request.model_id))
        self._agent_plans[request.request_id] = plan
        return plan

    async def _agent_place(self, plan: HopPlan | None, request, prompt: list[int],
                           ranked: list[Placement]) -> list[Placement]:
        """Reroute, pause decision, stale-KV release and promotion for one placed hop."""
        if plan is None:
            return ranked
        if plan.fallback.path is Fallback.REROUTE and len(ranked) > 1:
            def active(p: Placement) -> int:
                rec = self.view.membership.get(p.name)
                load = rec.load if rec and rec.load else ExecutorLoad()
                return max(load.num_running + load.num_waiting, self.inflight.num_requests(p.name))
            ranked = sorted(ranked, key=active)
        top = ranked[0]
        rec = self.view.membership.get(top.name)
        load = (rec.load if rec else None) or ExecutorLoad()
        total = (rec.num_blocks if rec else 0) or load.num_blocks
        pause = self.agent.pause(plan, top.name, max(0, load.num_blocks - load.num_free_blocks), total)
        if pause.decision.value != "none":
            catalogue.count_pause(pause.decision.value)
        # The executor orders its own queue by this (higher first) under its priority policy.
        request.priority = -plan.score(self.admission.clock())
        if plan.release is not None:
            await self._release_stale(plan, request.tenant)
        if plan.resumes_demoted and rec is not None:
            await self._promote(rec, request.tenant, prompt)
        return ranked

    async def reprioritize_forever(self, period_s: float = 0.5) -> None:
        """Every scheduling interval, re-estimate the priority of the requests already on
        executors and push it (one UpdatePriorities per executor): a long program's
        running hop sinks as its program's attained service grows, a deadline rises."""
        while True:
            await asyncio.sleep(period_s)
            now = self.admission.clock()
            by_executor: dict[str, list[tuple[str, float]]] = {}
            for rid, plan in list(self._agent_plans.items()):
                if plan.executor:
                    by_executor.setdefault(plan.executor, []).append((rid, -plan.score(now)))
            for name, items in by_executor.items():
                rec = self.view.membership.get(name)
                if rec is None:
                    continue
                try:
                    await self.channels.stub(rec.address).UpdatePriorities(executor_pb2.UpdatePrioritiesRequest(
                        request_ids=[r for r, _ in items], priorities=[p for _, p in items]), timeout=1.0)
                except grpc.aio.AioRpcError as exc:
                    log.debug("priority_update_failed", executor=name, code=exc.code().name)

    def _agent_exec_fields(self, request_id: str) -> dict:
        plan = self._agent_plans.get(request_id)
        if plan is None:
            return {}
        return {"pin_ttl_ms": plan.pause.pin_ttl_ms, "kv_quota_blocks": plan.request.terms.kv_quota_blocks}

    def _agent_observe(self, plan: HopPlan | None, chunk: scheduler_pb2.ScheduleResponse, t0: float) -> None:
        """Stamp the class / fallback / pause on the stream; record the hop when it ends."""
        if plan is None:
            return
        if plan.num_chunks == 0:
            chunk.request_class = _CLASS_TO_PB[plan.request_class]
            chunk.fallback_taken = _FALLBACK_TO_PB[plan.fallback.path]
            chunk.fallback_reason = plan.fallback.reason
            plan.num_cached_tokens = chunk.usage.num_cached_tokens
            plan.executor = chunk.executor
        plan.num_chunks += 1
        plan.output_token_ids.extend(chunk.token_ids_delta)
        if not chunk.finish_reason:
            return
        chunk.pause_decision = _PAUSE_TO_PB[plan.pause.decision]
        ses = self.agent.finish(plan, chunk.executor, plan.output_token_ids, plan.num_cached_tokens,
                                self._hop_entropy.get(plan.request.request_id, 0.0),
                                (time.monotonic() - t0) * 1000.0)
        if ses is not None and plan.pause.decision is not PauseDecision.NONE:
            log.info("session_paused", session_id=ses.session_id, decision=plan.pause.decision.value,
                     pin_ttl_ms=plan.pause.pin_ttl_ms, executor=chunk.executor, reason=plan.pause.reason)
        if ses is not None and plan.pause.decision is PauseDecision.DEMOTE:
            rec = self.view.membership.get(chunk.executor)
            if rec is not None:
                asyncio.get_running_loop().create_task(self._demote(rec, ses, plan))

    async def _release_stale(self, plan: HopPlan, tenant: str) -> None:
        rel = plan.release
        rec = self.view.membership.get(rel.executor)
        if rec is None:
            return
        keys = extra_keys_for(rec.model_id, tenant, rec.kv_cache_dtype)
        old = hash_block_chain(list(rel.stale_context_token_ids), rec.block_size, keys)
        keep = set(hash_block_chain(list(rel.new_prompt_token_ids), rec.block_size, keys))
        try:
            await self.channels.stub(rec.address).ReleaseSession(executor_pb2.ReleaseSessionRequest(
                session_id=executor_session_id(tenant, rel.session_id), evict_block_hashes=[h for h in old if h not in keep]), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("session_release_failed", executor=rec.name, details=exc.details())

    async def _demote(self, rec: ExecutorRecord, ses, plan: HopPlan) -> None:
        try:
            await self.channels.stub(rec.address).DemoteBlocks(executor_pb2.DemoteBlocksRequest(
                token_ids=ses.context_token_ids.tolist(), tenant_salt=ses.tenant,
                priority=-plan.score(time.monotonic()),
                expected_pause_ms=plan.request.expected_tool_ms, evict_local=True), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            no_tier = exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "cachestore" in (exc.details() or "")
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED or no_tier:
                self.agent.demote_unavailable(ses)
            else:
                log.warning("session_demote_failed", executor=rec.name, details=exc.details())
                ses.demoted = False
            return
        expected_s = (plan.request.expected_tool_ms or ses.observed_pause_ms) / 1000.0
        if expected_s > 0:  # prefetch: promote shortly before the tool is expected back
            await asyncio.sleep(0.8 * expected_s)
            if ses.demoted and ses.pause_started_s is not None:
                await self._promote(rec, ses.tenant, ses.context_token_ids.tolist())

    async def _promote(self, rec: ExecutorRecord, tenant: str, token_ids: list[int]) -> None:
        try:
            await self.channels.stub(rec.address).PromoteBlocks(executor_pb2.PromoteBlocksRequest(
                # force: the pause policy already priced the round trip when it chose demote.
                token_ids=token_ids, tenant_salt=tenant, partition=tenant, force=True), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            log.info("session_promote_skipped", executor=rec.name, code=exc.code().name)


_CLASS_FROM_PB = {
    common_v1.REQUEST_CLASS_INTERACTIVE: RequestClassName.INTERACTIVE,
    common_v1.REQUEST_CLASS_AGENTIC: RequestClassName.AGENTIC,
    common_v1.REQUEST_CLASS_DETERMINISTIC: RequestClassName.DETERMINISTIC,
    common_v1.REQUEST_CLASS_BATCH: RequestClassName.BATCH,
}
_CLASS_TO_PB = {v: k for k, v in _CLASS_FROM_PB.items()}
_FALLBACK_FROM_PB = {
    common_v1.FALLBACK_PATH_DEGRADE: Fallback.DEGRADE,
    common_v1.FALLBACK_PATH_REROUTE: Fallback.REROUTE,
    common_v1.FALLBACK_PATH_FAIL_FAST: Fallback.FAIL_FAST,
}
_FALLBACK_TO_PB = {Fallback.NONE: common_v1.FALLBACK_PATH_UNSPECIFIED, **{v: k for k, v in _FALLBACK_FROM_PB.items()}}
_PAUSE_TO_PB = {
    PauseDecision.NONE: common_v1.PAUSE_DECISION_UNSPECIFIED, PauseDecision.KEEP: common_v1.PAUSE_DECISION_KEEP,
    PauseDecision.DEMOTE: common_v1.PAUSE_DECISION_DEMOTE, PauseDecision.DROP: common_v1.PAUSE_DECISION_DROP,
}
