"""api/convert.py: the scheduler's one protobuf <-> domain boundary. A request becomes a
job and an attempt becomes the executor's request with the caller's fields passed
through; a chunk and its stamps become a ScheduleResponse; vocabularies map both ways."""
from __future__ import annotations

import pytest

from services.scheduler.api import convert
from services.scheduler.dispatch.job import Chunk, ExecutorCall
from services.scheduler.errors import InvalidScheduleRequest
from services.scheduler.policy.contracts import Fallback, FallbackChoice
from services.scheduler.policy.pause import PauseDecision
from services.scheduler.state.membership import ExecutorState
from services.shared.vocabulary import RequestClass, Rung
from weft.v1 import common_pb2, events_pb2, executor_pb2, scheduler_pb2


def request(**kw) -> scheduler_pb2.ScheduleRequest:
    base = dict(request_id="r", prompt_token_ids=[1, 2, 3], model_id="m", tenant="acme", priority=2.5)
    base.update(kw)
    return scheduler_pb2.ScheduleRequest(**base)


def test_a_request_becomes_a_job_with_its_class_contract_budget_and_seed():
    job = convert.job_from_pb(request(
        sampling=common_pb2.SamplingParams(max_tokens=9, min_tokens=2, seed=7),
        session=common_pb2.SessionInfo(session_id="s", request_class=common_pb2.REQUEST_CLASS_BATCH,
                                       contract=common_pb2.Contract(
                                           accepted_degrade_steps=[common_pb2.DEGRADE_STEP_KV_INT8],
                                           fallback=common_pb2.FALLBACK_PATH_REROUTE))))
    assert (job.max_tokens, job.min_tokens, job.seed, job.priority) == (9, 2, 7, 2.5)
    assert job.request_class is RequestClass.BATCH and job.class_label == "batch"
    assert job.contract.accepted == {Rung.NONE, Rung.KV_INT8, Rung.SHED}
    assert job.hop.terms.fallback is Fallback.REROUTE and job.hop.caller_priority == 2.5
    plain = convert.job_from_pb(request())
    assert plain.seed is None and plain.request_class is None and plain.class_label == ""


def test_a_bad_contract_step_is_refused_naming_the_field():
    bad = request(session=common_pb2.SessionInfo(contract=common_pb2.Contract(
        accepted_degrade_steps=[common_pb2.DEGRADE_STEP_UNSPECIFIED])))
    with pytest.raises(InvalidScheduleRequest) as err:
        convert.job_from_pb(bad)
    assert err.value.field == "session.contract.accepted_degrade_steps"


def _call(wire, **kw) -> ExecutorCall:
    base = dict(request_id="r", prompt_token_ids=(1, 2, 3, 4), tenant="acme", priority=-1.5,
                session_id="acme/s", max_tokens=5, min_tokens=0, seed=None, wire=wire)
    base.update(kw)
    return ExecutorCall(**base)


def test_an_attempt_passes_the_callers_sampling_through_with_its_own_budget_seed_and_scoped_session():
    wire = request(sampling=common_pb2.SamplingParams(max_tokens=9, temperature=0.5, seed=7),
                   session=common_pb2.SessionInfo(session_id="s", program_id="p"))
    out = convert.execute_request(_call(wire, seed=99, pin_ttl_ms=300, kv_quota_blocks=8))
    assert list(out.prompt_token_ids) == [1, 2, 3, 4] and out.tenant_salt == "acme"
    assert out.priority == -1.5 and (out.pin_ttl_ms, out.kv_quota_blocks) == (300, 8)
    assert (out.sampling.max_tokens, out.sampling.seed) == (5, 99)
    assert out.sampling.temperature == pytest.approx(0.5)
    assert out.session.session_id == "acme/s" and out.session.program_id == "p"
    bare = convert.execute_request(_call(request(), session_id=""))
    assert not bare.HasField("sampling") and bare.session.session_id == ""


def test_a_chunk_and_its_stamps_become_a_schedule_response():
    msg = executor_pb2.ExecuteResponse(request_id="r", token_ids_delta=[5], logprobs_delta=[-0.25],
                                       finish_reason=common_pb2.FINISH_REASON_STOP, executor="e")
    chunk = convert.chunk_from_pb(msg)
    assert chunk.finished and chunk.token_ids == (5,) and chunk.trailer_spans is None
    chunk.num_output_tokens, chunk.queue_ms, chunk.rung = 3, 12, Rung.KV_INT8
    chunk.request_class, chunk.pause = RequestClass.AGENTIC, PauseDecision.KEEP
    chunk.fallback, chunk.num_migrations = FallbackChoice(Fallback.DEGRADE, "why"), 1
    out = convert.schedule_response("r", chunk)
    assert list(out.token_ids_delta) == [5] and list(out.logprobs_delta) == [-0.25]
    assert out.finish_reason == common_pb2.FINISH_REASON_STOP and out.usage.num_output_tokens == 3
    assert out.degradation_rung == common_pb2.DEGRADATION_RUNG_KV_INT8 and out.queue_ms == 12
    assert out.request_class == common_pb2.REQUEST_CLASS_AGENTIC
    assert out.pause_decision == common_pb2.PAUSE_DECISION_KEEP
    assert (out.fallback_taken, out.fallback_reason) == (common_pb2.FALLBACK_PATH_DEGRADE, "why")
    assert out.num_migrations == 1
    unstamped = convert.schedule_response("r", Chunk((1,), False, "e", payload=executor_pb2.ExecuteResponse()))
    assert not unstamped.degradation_rung and not unstamped.request_class


def test_rungs_and_states_map_both_ways_and_unknown_rungs_are_never_placed():
    for rung in Rung:
        assert convert.rung_from_pb(convert.rung_to_pb(rung)) is rung
    assert convert.rung_from_pb(0) is Rung.NONE and convert.rung_from_pb(999) is Rung.SHED
    for state in ExecutorState:
        assert convert.STATES[convert.STATES_TO_PB[state]] is state
    assert set(convert.CLASSES.values()) == set(RequestClass)
    rec = convert.executor_record(events_pb2.ExecutorHeartbeat(name="e", address="a:1", block_size=16), False)
    assert rec.state is ExecutorState.JOINING and rec.interval_s == 1.0 and rec.kv_cache_dtype == "auto"
