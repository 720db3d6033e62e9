"""The Scheduler gRPC servicer and its NATS listeners: the only place scheduler protos
meet the domain (membership, kv index, placement, admission).

One request = one Scheduler.Generate stream relayed from one Executor.Generate stream:
no per-token round trips. The executor call inherits the request's deadline; when the
client goes away the relay is cancelled and cancels the executor call, which aborts
the request there. An executor that is unreachable before the first token is skipped
for the next-ranked one.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import structlog

from services.executor.block_hash import extra_keys_for, hash_block_chain
from services.mesh import metric_catalogue as catalogue
from services.mesh import metrics
from services.mesh.mesh_auth import mesh_channel
from services.mesh.grpc_server import DrainingError, channel_options
from services.mesh.timeline import TRACEPARENT_KEY, Trace, context_from_metadata, downstream_spans, spans_metadata
from services.mesh.logging import request_context
from services.mesh.nats_bus import Delivery, EventBus
from services.scheduler.admission import Admission
from services.scheduler.agent_plane import AgentPlane, HopPlan, HopRequest
from services.scheduler.contracts import ContractTerms, Fallback
from services.scheduler.pause_policy import PauseDecision
from services.scheduler.priority import RequestClassName
from weft.v1 import common_pb2 as common_v1
from services.scheduler.degradation import DegradationContract, DegradationLadder, LoadSignal, Rung, served_rung
from services.scheduler.errors import (
    DeadlineError, ExecutorLostError, InvalidScheduleRequest, NoExecutorError, OverloadedError,
)
from services.scheduler.kv_index import KvIndex
from services.scheduler.migration import (
    ExecutorFailed, MigrationExhausted, MigrationPolicy, NoReplacement, Piece, StreamProgress, migrating_stream,
    placement_marker,
)
from services.scheduler.membership import ExecutorLoad, ExecutorRecord, ExecutorState, Membership
from services.scheduler.placement import Candidate, InflightTracker, Placement, Placer
from services.scheduler.tenant_limits import TenantAdmission
from weft.v1.common_pb2 import DegradationRung as DegradationRungPb, RequestClass as RequestClassPb
from weft.v1 import common_pb2, events_pb2, executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)

REQUESTS = metrics.counter("weft_scheduler_requests_total", "Generate streams by outcome.", ["outcome"])
PLACED = metrics.counter("weft_scheduler_placements_total", "Requests placed per executor.", ["executor"])
MATCHED_BLOCKS = metrics.counter("weft_scheduler_prefix_blocks_matched_total", "Prompt blocks found on the chosen executor.")
PROMPT_BLOCKS = metrics.counter("weft_scheduler_prompt_blocks_total", "Full prompt blocks of placed requests.")
QUEUE_SECONDS = metrics.histogram("weft_scheduler_queue_seconds", "Time waiting for admission.")
EXECUTORS = metrics.gauge("weft_scheduler_executors", "Known executors.")

_STATES = {
    events_pb2.EXECUTOR_STATE_JOINING: ExecutorState.JOINING,
    events_pb2.EXECUTOR_STATE_SERVING: ExecutorState.SERVING,
    events_pb2.EXECUTOR_STATE_DRAINING: ExecutorState.DRAINING,
}
_STATES_BACK = {v: k for k, v in _STATES.items()}


class ChannelPool:
    """One gRPC channel per executor address, reused across requests."""

    def __init__(self, max_message_bytes: int) -> None:
        self._options = channel_options(max_message_bytes)
        self._stubs: dict[str, tuple[grpc.aio.Channel, executor_pb2_grpc.ExecutorStub]] = {}

    def stub(self, address: str) -> executor_pb2_grpc.ExecutorStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = mesh_channel(address, options=self._options)
            entry = (channel, executor_pb2_grpc.ExecutorStub(channel))
            self._stubs[address] = entry
        return entry[1]

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


class MeshView:
    """Membership + kv index fed by NATS events (heartbeat, load, kv)."""

    def __init__(self, membership: Membership, kv_index: KvIndex) -> None:
        self.membership = membership
        self.kv_index = kv_index
        membership.on_removed(self._forget)

    async def subscribe(self, bus: EventBus) -> None:
        await bus.subscribe("heartbeat", events_pb2.ExecutorHeartbeat, self.on_heartbeat)
        await bus.subscribe("load", events_pb2.LoadReport, self.on_load)
        await bus.subscribe("kv", events_pb2.KvEvent, self.on_kv)

    def on_heartbeat(self, msg: events_pb2.ExecutorHeartbeat, delivery: Delivery) -> None:
        if delivery is Delivery.RESTARTED:
            self.kv_index.drop_source(msg.name)
        rec = ExecutorRecord(
            name=msg.name, address=msg.address, model_id=msg.model_id, block_size=msg.block_size,
            state=_STATES.get(msg.state, ExecutorState.JOINING), max_num_seqs=msg.max_num_seqs,
            num_blocks=msg.num_blocks, max_model_len=msg.max_model_len,
            interval_s=(msg.interval_ms or 1000) / 1000.0, heartbeat_sequence=msg.header.sequence,
        )
        prev = self.membership.get(rec.name)
        if self.membership.heartbeat(rec):
            log.info("executor_joined", executor=rec.name, address=rec.address, model_id=rec.model_id,
                     state=rec.state.value)
        elif prev is not None and prev.state is not rec.state:
            log.info("executor_state_changed", executor=rec.name, state=rec.state.value)
        EXECUTORS.set(len(self.membership))

    def on_load(self, msg: events_pb2.LoadReport, delivery: Delivery) -> None:
        self.membership.update_load(msg.header.source, ExecutorLoad(
            num_running=msg.num_running, num_waiting=msg.num_waiting,
            num_free_blocks=msg.num_free_blocks, num_blocks=msg.num_blocks,
        ))

    def on_kv(self, msg: events_pb2.KvEvent, delivery: Delivery) -> None:
        if msg.tier not in (events_pb2.TIER_ACTIVE, events_pb2.TIER_UNSPECIFIED):
            # Cachestore tiers make no executor a prefix holder, but any executor can
            # load those blocks: the index keeps them apart (kv_index.py).
            source, tier = msg.header.source, events_pb2.Tier.Name(msg.tier)
            if delivery.needs_resync or msg.kind == events_pb2.KV_EVENT_KIND_CLEARED:
                self.kv_index.drop_store(source)
            if msg.kind == events_pb2.KV_EVENT_KIND_STORED:
                self.kv_index.store_stored(source, tier, msg.block_hashes)
            elif msg.kind == events_pb2.KV_EVENT_KIND_REMOVED:
                self.kv_index.store_removed(source, tier, msg.block_hashes)
            return
        source = msg.header.source
        if delivery.needs_resync:
            dropped = self.kv_index.drop_source(source)
            log.info("kv_index_resync", executor=source, reason=delivery.value, num_dropped=dropped)
        if msg.kind == events_pb2.KV_EVENT_KIND_STORED:
            self.kv_index.stored(source, msg.block_hashes)
        elif msg.kind == events_pb2.KV_EVENT_KIND_REMOVED:
            self.kv_index.removed(source, msg.block_hashes)
        elif msg.kind == events_pb2.KV_EVENT_KIND_CLEARED:
            self.kv_index.drop_source(source)

    def _forget(self, rec: ExecutorRecord) -> None:
        self.kv_index.drop_source(rec.name)
        EXECUTORS.set(len(self.membership))
        log.info("executor_removed", executor=rec.name, address=rec.address)

    async def expire_forever(self, bus: EventBus, period_s: float = 0.2) -> None:
        """Expire silent executors, but only while our own bus is connected: with NATS
        down every executor falls silent, and dropping them all would stop serving.
        (A dead executor is then found by its failed call and skipped.)"""
        was_connected = bus.connected
        while True:
            connected = bus.connected
            if connected and not was_connected:
                self.membership.refresh_all()
            elif connected:
                self.membership.expire()
            was_connected = connected
            await asyncio.sleep(period_s)


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _class_label(request: scheduler_pb2.ScheduleRequest) -> str:
    name = common_pb2.RequestClass.Name(request.session.request_class) if request.HasField("session") else ""
    return name.removeprefix("REQUEST_CLASS_").lower().replace("unspecified", "")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, view: MeshView, placer: Placer, admission: Admission, channels: ChannelPool,
                 placement_attempts: int = 2, migration: MigrationPolicy | None = None,
                 tenant_admission: TenantAdmission | None = None, ladder: DegradationLadder | None = None,
                 agent: AgentPlane | None = None) -> None:
        self.view = view
        self.placer = placer
        self.admission = admission
        self.migration = migration or MigrationPolicy()
        self.tenant_admission = tenant_admission or TenantAdmission(
            admission, admission.max_in_flight, admission.max_queue)  # default: no tighter per-tenant cap
        self.ladder = ladder or DegradationLadder()
        self.channels = channels
        self.placement_attempts = placement_attempts
        self.inflight = InflightTracker()
        self.draining = False
        self.agent = agent  # sessions, dynamic priority, contracts, pauses (agent_plane.py); None: plain
        self._agent_plans: dict[str, HopPlan] = {}
        self._hop_entropy: dict[str, float] = {}

    # -- placement ------------------------------------------------------------------
    def rank(self, model_id: str, tenant: str, prompt: Sequence[int]) -> list[Placement]:
        """Placeable executors, best first. Hashes are computed exactly as the executor
        does: its block size and extra_keys_for(its model id, tenant)."""
        records = self.view.membership.placeable(model_id)
        chains: dict[tuple[str, int], tuple[int, dict[str, int]]] = {}
        candidates = []
        for rec in records:
            key = (rec.model_id, rec.block_size)
            if key not in chains:
                hashes = hash_block_chain(prompt, rec.block_size, extra_keys_for(rec.model_id, tenant))
                chains[key] = (len(hashes), self.view.kv_index.match_prefix(hashes), hashes)
            num_prompt_blocks, matched, hashes = chains[key]
            load = rec.load or ExecutorLoad()
            reported_used = max(0, load.num_blocks - load.num_free_blocks)
            candidates.append(Candidate(
                name=rec.name, address=rec.address, num_prompt_blocks=num_prompt_blocks,
                num_matched_blocks=matched.get(rec.name, 0),
                num_store_blocks=self.view.kv_index.num_store_blocks(hashes, matched.get(rec.name, 0)),
                num_used_blocks=max(reported_used, self.inflight.num_blocks(rec.name)),
                num_blocks=rec.num_blocks or load.num_blocks,
                num_active_requests=max(load.num_running + load.num_waiting, self.inflight.num_requests(rec.name)),
                max_num_seqs=rec.max_num_seqs,
            ))
        return self.placer.rank(candidates)

    # -- RPCs -----------------------------------------------------------------------
    async def Generate(self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            raise DrainingError("scheduler is draining")
        rid = request.request_id
        if not rid:
            raise InvalidScheduleRequest("request_id", "must not be empty")
        if not request.prompt_token_ids:
            raise InvalidScheduleRequest("prompt_token_ids", "must contain at least one token")
        prompt = list(request.prompt_token_ids)
        plan = self._agent_begin(request)  # validates session / hop / contract; a stateful hop's full prompt
        if plan is not None:
            prompt = plan.prompt_token_ids
        with request_context(rid):
            t0 = time.monotonic()
            trace = Trace(rid, "scheduler", context_from_metadata(context.invocation_metadata()))
            try:
                self._shed_if_degraded(request)
                await self.tenant_admission.enter(request.tenant, plan.score if plan is not None else None)
            except OverloadedError:
                REQUESTS.labels("rejected").inc()
                self._agent_plans.pop(rid, None)
                catalogue.count_admission_rejection(self._rejection_reason(request))
                raise
            outcome = "cancelled"
            try:
                queue_s = time.monotonic() - t0
                QUEUE_SECONDS.observe(queue_s)
                catalogue.observe_queue_wait(_class_label(request), queue_s)
                admitted_ns = trace.span("scheduler.queue", trace.start_ns, time.time_ns()).end_ns
                ranked = self.rank(request.model_id, request.tenant, prompt)
                trace.span("scheduler.place", admitted_ns, time.time_ns(), num_candidates=len(ranked))
                if not ranked:
                    outcome = "no_executor"
                    catalogue.count_admission_rejection("no_executor")
                    raise NoExecutorError(f"no serving executor for model {request.model_id or '(any)'!r}")
                ranked = await self._agent_place(plan, request, prompt, ranked)
                async for chunk in self._migrating_relay(request, prompt, ranked, context, int(queue_s * 1000), trace):
                    self._agent_observe(plan, chunk, t0)
                    yield chunk
                outcome = "finished"
                context.set_trailing_metadata(spans_metadata(trace.finish(outcome=outcome)))
            except Exception:
                outcome = "error" if outcome == "cancelled" else outcome
                raise
            finally:
                self.tenant_admission.leave(request.tenant)
                self._agent_plans.pop(rid, None)
                self._hop_entropy.pop(rid, None)
                REQUESTS.labels(outcome).inc()

    def _timeout_s(self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext) -> float | None:
        timeouts = []
        remaining = context.time_remaining()
        if remaining is not None:
            timeouts.append(remaining)
        if request.deadline_unix_ms:
            timeouts.append(request.deadline_unix_ms / 1000.0 - time.time())
        if not timeouts:
            return None
        timeout = min(timeouts)
        if timeout <= 0:
            raise DeadlineError("deadline passed before the request was placed")
        return timeout

    async def _relay(self, request, prompt, ranked: list[Placement], context, queue_ms: int,
                     trace: Trace | None = None):
        exec_request = executor_pb2.ExecuteRequest(
            request_id=request.request_id, prompt_token_ids=prompt, sampling=request.sampling,
            tenant_salt=request.tenant, priority=request.priority, session=request.session,
            **self._agent_exec_fields(request.request_id),
        )
        if not request.HasField("sampling"):
            exec_request.ClearField("sampling")
        attempts = ranked[: self.placement_attempts]
        for i, placement in enumerate(attempts):
            rec = self.view.membership.get(placement.name)
            block_size = rec.block_size if rec else 16
            call_ns = time.time_ns()
            call = self.channels.stub(placement.address).Generate(
                exec_request, timeout=self._timeout_s(request, context),
                metadata=((TRACEPARENT_KEY, trace.context().traceparent()),) if trace else None)
            self.inflight.start(placement.name, request.request_id, _blocks(len(prompt), block_size))
            sent_any = False
            try:
                async for chunk in call:
                    if not sent_any:
                        PLACED.labels(placement.name).inc()
                        PROMPT_BLOCKS.inc(len(prompt) // block_size)
                        MATCHED_BLOCKS.inc(placement.num_matched_blocks)
                        log.info("request_placed", executor=placement.name,
                                 num_matched_blocks=placement.num_matched_blocks, queue_ms=queue_ms)
                    self.inflight.update(placement.name, request.request_id,
                                         _blocks(len(prompt) + chunk.usage.num_output_tokens, block_size))
                    if chunk.finish_reason:
                        self._hop_entropy[request.request_id] = chunk.mean_entropy
                    if chunk.finish_reason and trace is not None:
                        # The executor's spans are in the trailers that follow this last
                        # message: take them now, as the consumer may close us after it.
                        trace.span("scheduler.executor_call", call_ns, time.time_ns(), executor=placement.name,
                                   attempt=i, num_matched_blocks=placement.num_matched_blocks)
                        trace.add_downstream(await downstream_spans(call))
                    yield scheduler_pb2.ScheduleResponse(
                        request_id=request.request_id, token_ids_delta=chunk.token_ids_delta,
                        logprobs_delta=chunk.logprobs_delta, finish_reason=chunk.finish_reason,
                        usage=chunk.usage, executor=chunk.executor or placement.name,
                        queue_ms=queue_ms if not sent_any else 0,
                    )
                    sent_any = True
                return
            except grpc.aio.AioRpcError as exc:
                retryable = exc.code() == grpc.StatusCode.UNAVAILABLE
                if not sent_any and retryable and i + 1 < len(attempts):
                    log.warning("executor_unreachable", executor=placement.name, details=exc.details())
                    continue
                if sent_any and retryable:
                    raise ExecutorLostError(f"executor {placement.name} failed mid-stream: {exc.details()}") from exc
                raise
            finally:
                call.cancel()  # no-op when the call finished; aborts the executor's request otherwise
                self.inflight.finish(placement.name, request.request_id)

    # -- degradation and migration (services/scheduler/degradation.py, migration.py) --
    def _shed_if_degraded(self, request: scheduler_pb2.ScheduleRequest) -> Rung:
        """Observe load for the request's class; OverloadedError when the ladder sheds."""
        rung = self.ladder.observe(RequestClassPb.Name(request.session.request_class),
                                   LoadSignal(admission_fraction=self.tenant_admission.load_fraction()))
        catalogue.set_degradation_rung(_class_label(request), int(rung))
        if served_rung(rung, DegradationContract()) is Rung.SHED:
            raise OverloadedError("shed by the degradation ladder", retry_after_ms=self.admission.retry_after_ms())
        return rung

    def _rejection_reason(self, request: scheduler_pb2.ScheduleRequest) -> str:
        """Why admission refused ``request``: the ladder sheds its class, or a queue (the
        tenant's or the scheduler's) is full."""
        rung = self.ladder.rungs().get(RequestClassPb.Name(request.session.request_class), Rung.NONE)
        return "shed" if served_rung(rung, DegradationContract()) is Rung.SHED else "queue_full"

    async def _migrating_relay(self, request, prompt, ranked: list[Placement], context, queue_ms: int, *relay_args):
        """``_relay`` wrapped in migration: when the executor dies or stalls mid-stream the
        request continues elsewhere from prompt + tokens so far (one stream to the client,
        usage counted across attempts). Attempts are bounded; then UNAVAILABLE."""
        sampling = request.sampling
        progress = StreamProgress(tuple(prompt), sampling.max_tokens, sampling.min_tokens,
                                  sampling.seed if sampling.HasField("seed") else None)
        rung = served_rung(self.ladder.rungs().get(RequestClassPb.Name(request.session.request_class), Rung.NONE),
                           DegradationContract())
        cached: list[int] = []

        def open_attempt(attempt):
            placements = ranked
            if attempt.index:
                placements = [p for p in self.rank(request.model_id, request.tenant, list(attempt.prompt_token_ids))
                              if p.name not in attempt.exclude]
                if not placements:
                    raise NoReplacement(f"every placeable executor failed: {sorted(attempt.exclude)}")
            sub = scheduler_pb2.ScheduleRequest()
            sub.CopyFrom(request)
            del sub.prompt_token_ids[:]
            sub.prompt_token_ids.extend(attempt.prompt_token_ids)
            if request.HasField("sampling"):
                sub.sampling.max_tokens, sub.sampling.min_tokens = attempt.max_tokens, attempt.min_tokens
                if attempt.seed is not None:
                    sub.sampling.seed = attempt.seed
            return pieces(sub, placements, 0 if attempt.index else queue_ms)

        async def pieces(sub, placements, attempt_queue_ms):
            executor = placements[0].name
            yield placement_marker(executor)  # a stall before the first token is pinned on it
            try:
                async for chunk in self._relay(sub, list(sub.prompt_token_ids), placements, context,
                                               attempt_queue_ms, *relay_args):
                    executor = chunk.executor or executor
                    yield Piece(tuple(chunk.token_ids_delta), chunk.executor, chunk.finish_reason != 0, chunk)
            except ExecutorLostError as exc:
                raise ExecutorFailed(executor, str(exc)) from exc
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                    raise
                raise ExecutorFailed(executor, f"{exc.code().name}: {exc.details()}") from exc

        first = True
        trace = relay_args[0] if relay_args else None
        num_migrations_seen, last_piece_ns = 0, time.time_ns()
        try:
            async for piece in migrating_stream(progress, self.migration, open_attempt):
                chunk = piece.payload
                if progress.num_migrations != num_migrations_seen:
                    # What the move cost this request: the gap since the last piece before it.
                    catalogue.count_migration("executor_failed", progress.num_migrations - num_migrations_seen)
                    if trace is not None:
                        trace.span("scheduler.migration", last_piece_ns, time.time_ns(),
                                   num_migrations=progress.num_migrations, executor=piece.executor)
                    num_migrations_seen = progress.num_migrations
                last_piece_ns = time.time_ns()
                if first:
                    cached.append(chunk.usage.num_cached_tokens)
                    chunk.degradation_rung = DegradationRungPb.Value(f"DEGRADATION_RUNG_{rung.name}")
                    first = False
                if progress.num_migrations:
                    chunk.usage.num_prompt_tokens = len(prompt)
                    chunk.usage.num_cached_tokens = cached[0]
                    chunk.usage.num_output_tokens = len(progress.output_token_ids)
                    if chunk.finish_reason:
                        chunk.num_migrations = progress.num_migrations
                yield chunk
        except MigrationExhausted as exc:
            raise ExecutorLostError(str(exc)) from exc

    async def ListExecutors(self, request, context) -> scheduler_pb2.ListExecutorsResponse:
        now = self.view.membership.clock()
        out = scheduler_pb2.ListExecutorsResponse()
        for rec in self.view.membership.all():
            info = out.executors.add(
                heartbeat=events_pb2.ExecutorHeartbeat(
                    header=events_pb2.EventHeader(source=rec.name, sequence=rec.heartbeat_sequence),
                    name=rec.name, address=rec.address, model_id=rec.model_id, block_size=rec.block_size,
                    state=_STATES_BACK[rec.state], max_num_seqs=rec.max_num_seqs, num_blocks=rec.num_blocks,
                    interval_ms=int(rec.interval_s * 1000), max_model_len=rec.max_model_len,
                ),
                num_indexed_blocks=self.view.kv_index.num_blocks(rec.name),
                last_seen_ago_ms=int(max(0.0, now - rec.last_seen_s) * 1000),
            )
            if rec.load is not None:
                info.load.CopyFrom(events_pb2.LoadReport(
                    num_running=rec.load.num_running, num_waiting=rec.load.num_waiting,
                    num_free_blocks=rec.load.num_free_blocks, num_blocks=rec.load.num_blocks,
                ))
        return out

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
                                _FALLBACK_FROM_PB.get(c.fallback, Fallback.NONE)),
            caller_priority=request.priority,
        )
        pool = max((r.num_blocks for r in self.view.membership.placeable(request.model_id)), default=0)
        plan = self.agent.begin(hop, pool)
        a = self.admission
        ahead = a.num_ahead(plan.score(a.clock())) + (1 if a.num_in_flight >= a.max_in_flight else 0)
        self.agent.fallback(plan, ahead, a.max_in_flight)  # FAIL_FAST raises OverloadedError
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
        keys = extra_keys_for(rec.model_id, tenant)
        old = hash_block_chain(list(rel.stale_context_token_ids), rec.block_size, keys)
        keep = set(hash_block_chain(list(rel.new_prompt_token_ids), rec.block_size, keys))
        try:
            await self.channels.stub(rec.address).ReleaseSession(executor_pb2.ReleaseSessionRequest(
                session_id=rel.session_id, evict_block_hashes=[h for h in old if h not in keep]), timeout=2.0)
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
