"""Every protobuf ⇄ domain conversion of the scheduler, in one file.

NOTE: the wire enums are another spelling of the shared vocabulary
(services/shared/vocabulary.py): ``DegradationRung`` ⇄ ``Rung``, ``RequestClass`` ⇄
``RequestClass``; an UNSPECIFIED value is "not said" (None, or the rung ``none``), a value
this scheduler does not know is handled where it is read. Priority crosses as it is:
higher runs first on both sides.
"""
from __future__ import annotations

from collections.abc import Callable

from services.mesh.timeline import TraceContext, downstream_spans
from services.scheduler.agent_plane import HopRequest
from services.scheduler.dispatch.job import Chunk, Decisions, ExecutorCall, Job
from services.scheduler.errors import InvalidScheduleRequest
from services.scheduler.policy.contracts import ContractTerms, Fallback
from services.scheduler.policy.degradation import DegradationContract, Rung
from services.scheduler.policy.pause import PauseDecision
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import ExecutorLoad, ExecutorRecord, ExecutorState, MeasuredRates, Membership
from services.shared.vocabulary import RequestClass
from weft.v1 import common_pb2, events_pb2, executor_pb2, scheduler_pb2

# -- vocabularies ------------------------------------------------------------------------
STATES = {
    events_pb2.EXECUTOR_STATE_JOINING: ExecutorState.JOINING,
    events_pb2.EXECUTOR_STATE_SERVING: ExecutorState.SERVING,
    events_pb2.EXECUTOR_STATE_DRAINING: ExecutorState.DRAINING,
    events_pb2.EXECUTOR_STATE_FAILED: ExecutorState.FAILED,
}
STATES_TO_PB = {v: k for k, v in STATES.items()}
CLASSES = {
    common_pb2.REQUEST_CLASS_INTERACTIVE: RequestClass.INTERACTIVE,
    common_pb2.REQUEST_CLASS_AGENTIC: RequestClass.AGENTIC,
    common_pb2.REQUEST_CLASS_DETERMINISTIC: RequestClass.DETERMINISTIC,
    common_pb2.REQUEST_CLASS_BATCH: RequestClass.BATCH,
}
CLASSES_TO_PB = {v: k for k, v in CLASSES.items()}
FALLBACKS = {
    common_pb2.FALLBACK_PATH_DEGRADE: Fallback.DEGRADE,
    common_pb2.FALLBACK_PATH_REROUTE: Fallback.REROUTE,
    common_pb2.FALLBACK_PATH_FAIL_FAST: Fallback.FAIL_FAST,
}
FALLBACKS_TO_PB = {Fallback.NONE: common_pb2.FALLBACK_PATH_UNSPECIFIED, **{v: k for k, v in FALLBACKS.items()}}
PAUSES_TO_PB = {
    PauseDecision.NONE: common_pb2.PAUSE_DECISION_UNSPECIFIED, PauseDecision.KEEP: common_pb2.PAUSE_DECISION_KEEP,
    PauseDecision.DEMOTE: common_pb2.PAUSE_DECISION_DEMOTE, PauseDecision.DROP: common_pb2.PAUSE_DECISION_DROP,
}


def rung_from_pb(value: int) -> Rung:
    """A ``DegradationRung`` enum value → Rung. UNSPECIFIED (an older sender): none; a value
    this scheduler does not know (a newer sender): shed, which no request is placed on."""
    if not value:
        return Rung.NONE
    try:
        return Rung.parse(common_pb2.DegradationRung.Name(value).removeprefix("DEGRADATION_RUNG_"))
    except ValueError:
        return Rung.SHED


def rung_to_pb(rung: Rung) -> int:
    return common_pb2.DegradationRung.Value(f"DEGRADATION_RUNG_{rung.name}")


def degradation_contract(contract: common_pb2.Contract) -> DegradationContract:
    """The accepted rungs of a ``weft.v1.Contract`` (none listed: every rung); raises
    InvalidScheduleRequest naming the field on an unset step."""
    labels = []
    for step in contract.accepted_degrade_steps:
        if step == common_pb2.DEGRADE_STEP_UNSPECIFIED or step not in common_pb2.DegradeStep.values():
            raise InvalidScheduleRequest("session.contract.accepted_degrade_steps",
                                         f"unknown degradation step {step}")
        labels.append(common_pb2.DegradeStep.Name(step).removeprefix("DEGRADE_STEP_").lower())
    return DegradationContract.from_labels(labels)


# -- the request path ----------------------------------------------------------------------
def job_from_pb(request: scheduler_pb2.ScheduleRequest, time_remaining_s: Callable[[], float | None] = lambda: None,
                trace_parent: TraceContext | None = None) -> Job:
    """A ScheduleRequest as the dispatcher reads it; raises InvalidScheduleRequest naming a
    bad contract field or a request class this scheduler does not know (the router refuses
    one as well: the class drives admission, priority and the contract, so none is guessed).
    The request itself rides along (``wire``) for ``execute_request``."""
    ses, c, sampling = request.session, request.session.contract, request.sampling
    if ses.request_class not in CLASSES and ses.request_class != common_pb2.REQUEST_CLASS_UNSPECIFIED:
        raise InvalidScheduleRequest("session.request_class", f"unknown request class {ses.request_class}")
    request_class = CLASSES.get(ses.request_class)
    contract = degradation_contract(c)
    prompt = list(request.prompt_token_ids)  # once: ~90 us for an agent hop's 2k ids; both only read it
    hop = HopRequest(
        request_id=request.request_id, tenant=request.tenant, prompt_token_ids=prompt,
        session_id=ses.session_id, program_id=ses.program_id, hop_index=ses.hop_index,
        expected_tool_ms=ses.expected_tool_ms, stateful=ses.stateful, request_class=request_class,
        terms=ContractTerms(c.kv_quota_blocks, c.ttft_ceiling_ms, c.tpot_ceiling_ms,
                            FALLBACKS.get(c.fallback, Fallback.NONE), contract),
        caller_priority=request.priority, fork_id=request.fork_id,
    )
    return Job(
        request_id=request.request_id, prompt_token_ids=prompt, model_id=request.model_id,
        tenant=request.tenant, priority=request.priority, max_tokens=sampling.max_tokens,
        min_tokens=sampling.min_tokens, seed=sampling.seed if sampling.HasField("seed") else None,
        request_class=request_class, contract=contract, hop=hop, session_id=ses.session_id,
        deadline_unix_ms=request.deadline_unix_ms, time_remaining_s=time_remaining_s, trace_parent=trace_parent,
        wire=request,
    )


def execute_request(call: ExecutorCall) -> executor_pb2.ExecuteRequest:
    """The executor's request for one attempt: the caller's sampling and session passed
    through, with this attempt's prompt, token budget, seed and scoped session id."""
    wire: scheduler_pb2.ScheduleRequest = call.wire
    out = executor_pb2.ExecuteRequest(
        request_id=call.request_id, prompt_token_ids=call.prompt_token_ids, sampling=wire.sampling,
        tenant_salt=call.tenant, priority=call.priority, session=wire.session,
        pin_ttl_ms=call.pin_ttl_ms, kv_quota_blocks=call.kv_quota_blocks,
    )
    if wire.session.session_id:  # executors pin by this id alone: scoped by tenant
        out.session.session_id = call.session_id
    if not wire.HasField("sampling"):
        out.ClearField("sampling")
    else:
        out.sampling.max_tokens, out.sampling.min_tokens = call.max_tokens, call.min_tokens
        if call.seed is not None:
            out.sampling.seed = call.seed
    if call.resumed_output_tokens:
        out.sampling.resumed_output_tokens = wire.sampling.resumed_output_tokens + call.resumed_output_tokens
    return out


def chunk_from_pb(msg: executor_pb2.ExecuteResponse, call=None) -> Chunk:
    """One executor message as a chunk; ``call``: its gRPC call, whose trailers carry the
    executor's spans after the last message."""
    finished = msg.finish_reason != 0
    return Chunk(
        token_ids=tuple(msg.token_ids_delta), finished=finished, executor=msg.executor,
        num_prompt_tokens=msg.usage.num_prompt_tokens, num_cached_tokens=msg.usage.num_cached_tokens,
        num_output_tokens=msg.usage.num_output_tokens, mean_entropy=msg.mean_entropy,
        trailer_spans=(lambda: downstream_spans(call)) if finished and call is not None else None, payload=msg,
    )


def schedule_response(request_id: str, chunk: Chunk) -> scheduler_pb2.ScheduleResponse:
    msg: executor_pb2.ExecuteResponse = chunk.payload
    out = scheduler_pb2.ScheduleResponse(
        request_id=request_id, token_ids_delta=chunk.token_ids, logprobs_delta=msg.logprobs_delta,
        top_logprobs_delta=msg.top_logprobs_delta, prompt_logprobs=msg.prompt_logprobs,
        prompt_top_logprobs=msg.prompt_top_logprobs,
        finish_reason=msg.finish_reason, executor=chunk.executor, queue_ms=chunk.queue_ms,
        usage=common_pb2.Usage(num_prompt_tokens=chunk.num_prompt_tokens, num_cached_tokens=chunk.num_cached_tokens,
                               num_output_tokens=chunk.num_output_tokens),
    )
    if chunk.rung is not None:
        out.degradation_rung = rung_to_pb(chunk.rung)
    if chunk.request_class is not None:
        out.request_class = CLASSES_TO_PB[chunk.request_class]
    if chunk.fallback is not None:
        out.fallback_taken = FALLBACKS_TO_PB[chunk.fallback.path]
        out.fallback_reason = chunk.fallback.reason
    if chunk.pause is not None:
        out.pause_decision = PAUSES_TO_PB[chunk.pause]
    if chunk.num_migrations:
        out.num_migrations = chunk.num_migrations
    if chunk.decisions is not None:
        out.decisions.CopyFrom(decisions_to_pb(chunk.decisions))
    return out


def decisions_to_pb(d: Decisions) -> common_pb2.SchedulingDecisions:
    """The wire form of a chunk's decisions (unset fields stay at their zero: "not decided")."""
    out = common_pb2.SchedulingDecisions(
        priority=d.priority, queue_ms=d.queue_ms, intent_shift=d.intent_shift, intent_distance=d.intent_distance,
        ttft_estimate_ms=max(0, d.ttft_estimate_ms), ttft_ceiling_ms=d.ttft_ceiling_ms,
        ttft_achieved_ms=round(d.ttft_achieved_ms) if d.ttft_achieved_ms is not None else 0,
        expected_cached_tokens=d.expected_cached_tokens,
    )
    if d.request_class is not None:
        out.request_class = CLASSES_TO_PB[d.request_class]
    if d.fallback is not None:
        out.fallback_taken = FALLBACKS_TO_PB[d.fallback.path]
        out.fallback_reason = d.fallback.reason
    if d.rung is not None:
        out.degradation_rung = rung_to_pb(d.rung)
    if d.pause is not None:
        out.pause_decision = PAUSES_TO_PB[d.pause]
    return out


# -- the mesh --------------------------------------------------------------------------------
def executor_record(msg: events_pb2.ExecutorHeartbeat, verified: bool) -> ExecutorRecord:
    return ExecutorRecord(
        name=msg.name, address=msg.address, model_id=msg.model_id, block_size=msg.block_size,
        state=STATES.get(msg.state, ExecutorState.JOINING), max_num_seqs=msg.max_num_seqs,
        num_blocks=msg.num_blocks, max_model_len=msg.max_model_len,
        interval_s=(msg.interval_ms or 1000) / 1000.0, heartbeat_sequence=msg.header.sequence,
        serves_rung=rung_from_pb(msg.serves_rung), kv_cache_dtype=msg.kv_cache_dtype or "auto", verified=verified,
    )


def executor_load(msg: events_pb2.LoadReport) -> ExecutorLoad:
    rates = MeasuredRates(
        prefill_tokens_per_s=msg.prefill_tokens_per_s, num_prefills=msg.num_prefills,
        transfer_bytes_per_s=msg.transfer_bytes_per_s, num_transfers=msg.num_transfers,
        block_bytes=msg.block_bytes,
        transfer_overhead_ms=msg.transfer_overhead_ms if 0 <= msg.transfer_overhead_ms < float("inf") else 0.0)
    return ExecutorLoad(num_running=msg.num_running, num_waiting=msg.num_waiting,
                        num_free_blocks=msg.num_free_blocks, num_blocks=msg.num_blocks, rates=rates)


def load_report(load: ExecutorLoad) -> events_pb2.LoadReport:
    """``executor_load``'s inverse (ListExecutors shows the latest report, rates included)."""
    r = load.rates
    return events_pb2.LoadReport(
        num_running=load.num_running, num_waiting=load.num_waiting, num_free_blocks=load.num_free_blocks,
        num_blocks=load.num_blocks, prefill_tokens_per_s=r.prefill_tokens_per_s, num_prefills=r.num_prefills,
        transfer_bytes_per_s=r.transfer_bytes_per_s, num_transfers=r.num_transfers, block_bytes=r.block_bytes,
        transfer_overhead_ms=r.transfer_overhead_ms)


def list_executors_response(membership: Membership, kv_index: KvIndex) -> scheduler_pb2.ListExecutorsResponse:
    now = membership.clock()
    out = scheduler_pb2.ListExecutorsResponse()
    for rec in membership.all():
        info = out.executors.add(
            heartbeat=events_pb2.ExecutorHeartbeat(
                header=events_pb2.EventHeader(source=rec.name, sequence=rec.heartbeat_sequence),
                name=rec.name, address=rec.address, model_id=rec.model_id, block_size=rec.block_size,
                state=STATES_TO_PB[rec.state], max_num_seqs=rec.max_num_seqs, num_blocks=rec.num_blocks,
                interval_ms=int(rec.interval_s * 1000), max_model_len=rec.max_model_len,
                serves_rung=rung_to_pb(rec.serves_rung),
            ),
            num_indexed_blocks=kv_index.num_blocks(rec.name),
            last_seen_ago_ms=int(max(0.0, now - rec.last_seen_s) * 1000),
        )
        if rec.load is not None:
            info.load.CopyFrom(load_report(rec.load))
    return out
