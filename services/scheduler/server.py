"""The Scheduler gRPC servicer and its NATS listeners: the only place scheduler protos
meet the domain (membership, kv index, placement, admission).

One request = one Scheduler.Generate stream relayed from one Executor.Generate stream:
no per-token round trips. The executor call inherits the request's deadline; when the
client goes away the relay is cancelled and cancels the executor call, which aborts
the request there. An executor that is unreachable before the first token is skipped
for the next-ranked one.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
import structlog

from services.shared.block_hash import extra_keys_for, hash_block_chain
from services.mesh import metric_catalogue as catalogue
from services.mesh import metrics
from services.mesh.grpc_server import DrainingError
from services.mesh.timeline import TRACEPARENT_KEY, Trace, context_from_metadata, downstream_spans, spans_metadata
from services.mesh.logging import request_context
from services.scheduler.policy.admission import Admission
from services.scheduler.agent_plane import AgentPlane, HopPlan
from services.scheduler.policy.degradation import DegradationLadder, Rung
from services.scheduler.errors import (
    DeadlineError, ExecutorLostError, InvalidScheduleRequest, NoExecutorError, OverloadedError, SuspectedPoisonError,
)
from services.scheduler.policy.suspects import SuspectedPoison, SuspectRegistry, is_engine_failure
from services.scheduler.server_agent import AgentHooks
from services.scheduler.server_degrade import DegradeHooks
from services.scheduler.server_view import _STATES_BACK, ChannelPool, MeshView, rung_to_pb
from services.scheduler.migration import (
    ExecutorFailed, MigrationExhausted, MigrationPolicy, NoReplacement, Piece, StreamProgress, migrating_stream,
    placement_marker,
)
from services.scheduler.state.membership import ExecutorLoad
from services.scheduler.policy.placement import Candidate, InflightTracker, Placement, Placer
from services.scheduler.state.sessions import executor_session_id
from services.scheduler.policy.tenant_limits import TenantAdmission
from weft.v1 import common_pb2, events_pb2, executor_pb2, scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)

REQUESTS = metrics.counter("weft_scheduler_requests_total", "Generate streams by outcome.", ["outcome"])
PLACED = metrics.counter("weft_scheduler_placements_total", "Requests placed per executor.", ["executor"])
MATCHED_BLOCKS = metrics.counter("weft_scheduler_prefix_blocks_matched_total", "Prompt blocks found on the chosen executor.")
PROMPT_BLOCKS = metrics.counter("weft_scheduler_prompt_blocks_total", "Full prompt blocks of placed requests.")
QUEUE_SECONDS = metrics.histogram("weft_scheduler_queue_seconds", "Time waiting for admission.")


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _class_label(request: scheduler_pb2.ScheduleRequest) -> str:
    name = common_pb2.RequestClass.Name(request.session.request_class) if request.HasField("session") else ""
    return name.removeprefix("REQUEST_CLASS_").lower().replace("unspecified", "")


class SchedulerServicer(AgentHooks, DegradeHooks, scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, view: MeshView, placer: Placer, admission: Admission, channels: ChannelPool,
                 placement_attempts: int = 2, migration: MigrationPolicy | None = None,
                 tenant_admission: TenantAdmission | None = None, ladder: DegradationLadder | None = None,
                 agent: AgentPlane | None = None) -> None:
        self.view = view
        self.placer = placer
        self.admission = admission
        self.migration = migration or MigrationPolicy()
        self.suspects = SuspectRegistry()  # ids that rode too many engine deaths (suspects.py)
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
    def rank(self, model_id: str, tenant: str, prompt: Sequence[int], rung: Rung = Rung.NONE) -> list[Placement]:
        """Placeable executors serving ``rung``, best first. Hashes are computed exactly as
        the executor does: its block size and extra_keys_for(its model id, tenant, KV dtype)."""
        records = self.view.membership.placeable(model_id, rung)
        chains: dict[tuple[str, int, str], tuple[int, dict[str, int], list[int]]] = {}
        candidates = []
        for rec in records:
            key = (rec.model_id, rec.block_size, rec.kv_cache_dtype)
            if key not in chains:
                keys = extra_keys_for(rec.model_id, tenant, rec.kv_cache_dtype)
                hashes = hash_block_chain(prompt, rec.block_size, keys)
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
        suspected = self.suspects.reason(rid)
        if suspected is not None:  # a resend of a suspected poison pill: no executor is risked again
            raise SuspectedPoisonError(suspected)
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
                rung = self._serve_rung(request)
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
                ranked = self.rank(request.model_id, request.tenant, prompt, rung)
                if not ranked and rung is not Rung.NONE:  # its pool left while it queued
                    rung = Rung.NONE
                    ranked = self.rank(request.model_id, request.tenant, prompt, rung)
                trace.span("scheduler.place", admitted_ns, time.time_ns(), num_candidates=len(ranked),
                           rung=rung.label)
                if not ranked:
                    outcome = "no_executor"
                    catalogue.count_admission_rejection("no_executor")
                    raise NoExecutorError(f"no serving executor for model {request.model_id or '(any)'!r}")
                ranked = await self._agent_place(plan, request, prompt, ranked)
                async for chunk in self._migrating_relay(request, prompt, ranked, context, int(queue_s * 1000), trace,
                                                         rung=rung):
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
        if request.session.session_id:  # executors pin by this id alone: scope it by tenant
            exec_request.session.session_id = executor_session_id(request.tenant, request.session.session_id)
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

    # -- migration (services/scheduler/migration.py); degradation: server_degrade.py --
    async def _migrating_relay(self, request, prompt, ranked: list[Placement], context, queue_ms: int, *relay_args,
                               rung: Rung = Rung.NONE):
        """``_relay`` wrapped in migration: when the executor dies or stalls mid-stream the
        request continues elsewhere from prompt + tokens so far (one stream to the client,
        usage counted across attempts), on another executor serving the same ``rung`` (else
        a full-quality one: never the reverse). Attempts are bounded; then UNAVAILABLE."""
        sampling = request.sampling
        progress = StreamProgress(tuple(prompt), sampling.max_tokens, sampling.min_tokens,
                                  sampling.seed if sampling.HasField("seed") else None)
        cached: list[int] = []

        def open_attempt(attempt):
            placements = ranked
            if attempt.index:
                for pool in (rung, Rung.NONE):  # a degraded request whose pool is gone ends at full quality
                    placements = [p for p in self.rank(request.model_id, request.tenant,
                                                       list(attempt.prompt_token_ids), pool)
                                  if p.name not in attempt.exclude]
                    if placements:
                        break
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
                raise ExecutorFailed(executor, str(exc), is_engine_failure(exc)) from exc
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                    raise
                details = exc.details() or ""
                raise ExecutorFailed(executor, f"{exc.code().name}: {details}", is_engine_failure(exc)) from exc

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
                    chunk.degradation_rung = rung_to_pb(rung)
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
        except SuspectedPoison as exc:
            self.suspects.add(request.request_id, str(exc))
            log.error("request_suspected_poison", request_id=request.request_id, reason=str(exc))
            raise SuspectedPoisonError(str(exc)) from exc

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
                    serves_rung=rung_to_pb(rec.serves_rung),
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
