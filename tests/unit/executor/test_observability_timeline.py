"""Timelines (trace context, spans through gRPC metadata, the store) and the executor's
step trace on a real tiny engine: KV-blocked waits, preemptions and KV gauges."""
from __future__ import annotations

import pytest

from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.step_trace import StepTrace, add_executor_spans
from services.mesh import metric_catalogue as catalogue
from services.mesh.timeline import (
    MAX_SPANS_PER_SERVICE, TimelineStore, Trace, TraceContext, context_from_metadata, spans_from_metadata,
    spans_metadata, timeline_json,
)
from weft.testing.tiny_model import make_tiny_checkpoint


def test_traceparent_round_trips_and_malformed_values_start_a_new_trace():
    ctx = TraceContext("ab" * 16, "cd" * 8)
    assert TraceContext.parse(ctx.traceparent()) == ctx
    for bad in (None, "", "00-xyz-cd-01", "00-" + "g" * 32 + "-" + "c" * 16 + "-01"):
        assert TraceContext.parse(bad) is None
    child = Trace("r1", "scheduler", context_from_metadata([("other", "x"), ("traceparent", ctx.traceparent())]))
    assert child.trace_id == ctx.trace_id and child.parent_id == ctx.parent_span_id
    assert Trace("r2", "router", None).trace_id != Trace("r3", "router", None).trace_id


def test_spans_cross_as_trailing_metadata_with_parents_linking_the_services():
    router = Trace("r1", "router")
    sched = Trace("r1", "scheduler", router.context())
    sched.event("scheduler.placed", executor="executor-0")
    executor = Trace("r1", "executor", sched.context())
    sched.add_downstream(spans_from_metadata(spans_metadata(executor.finish())))
    router.add_downstream(spans_from_metadata(spans_metadata(sched.finish())))
    spans = {s.name: s for s in router.finish()}
    assert spans["scheduler.request"].parent_id == spans["router.request"].span_id
    assert spans["executor.request"].parent_id == spans["scheduler.request"].span_id
    assert spans["scheduler.placed"].attrs == {"executor": "executor-0"}
    assert {s.trace_id for s in spans.values()} == {router.trace_id}
    assert spans_from_metadata([("weft-spans", "not json")]) == []


def test_a_service_records_a_bounded_number_of_spans():
    t = Trace("r", "executor")
    for i in range(MAX_SPANS_PER_SERVICE * 3):
        t.event("executor.prefill_chunk", index=i)
    assert len(t.finish()) <= MAX_SPANS_PER_SERVICE


def test_store_keeps_the_latest_requests_merges_parts_and_orders_by_start():
    store = TimelineStore(capacity=2)
    a = Trace("a", "router", start_ns=100)
    a.span("router.first_token", 300)
    a.finish(store)
    b = Trace("a", "scheduler", a.context(), start_ns=200)
    store.add("a", b.finish())
    store.add("a", b.finish())  # the same spans twice are kept once
    names = [s.name for s in store.get("a")]
    assert names == ["router.request", "scheduler.request", "router.first_token"]
    store.add("b", [])
    store.add("c", [])
    assert store.get("a") is None and len(store) == 2
    doc = timeline_json("a", [s for s in [*a.finish(), *b.finish()]])
    assert doc["services"] == ["router", "scheduler"] and doc["spans"][0]["offset_ms"] == 0.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


def _run_traced(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    for _ in range(500):
        if not engine.has_unfinished_requests:
            return
        engine.step()
    raise AssertionError("engine still busy")


def _sample(name: str, **labels) -> float:
    return catalogue.metric(name).labels(**labels)._value.get()


def test_step_trace_records_chunks_kv_blocked_waits_and_preemptions_on_a_full_pool(checkpoint):
    # 8 blocks of 16 tokens: two 60-token prompts growing by 40 tokens cannot both fit.
    name = "executor-steptrace-test"
    trace = StepTrace(name)
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=8, block_size=16, max_prefill_chunk=32), step_trace=trace)
    preempted_before = _sample("weft_kv_preemptions_total", executor=name)
    _run_traced(engine, {"a": list(range(10, 70)), "b": list(range(100, 160))}, max_tokens=40)
    recs = {rid: trace.pop(rid) for rid in ("a", "b")}
    assert all(len(r.chunks) >= 2 for r in recs.values())  # 60 tokens in chunks of 32
    assert sum(len(r.preempted) for r in recs.values()) == engine.num_preemptions > 0
    assert _sample("weft_kv_preemptions_total", executor=name) - preempted_before == engine.num_preemptions
    assert sum(r.kv_blocked_ns for r in recs.values()) > 0
    trace.update_gauges(engine)
    assert _sample("weft_kv_pool_blocks", executor=name, state="total") == 8
    assert _sample("weft_kv_blocks", executor=name, partition="default", state="used") == 0
    assert trace.pop("a").first_scheduled_ns is None  # popped records are gone


def test_executor_spans_are_ordered_and_the_kv_gauges_move_while_a_request_runs(checkpoint):
    name = "executor-gauge-test"
    trace = StepTrace(name)
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=64, block_size=16), step_trace=trace)
    t = Trace("r", "executor")  # received now, before the first step
    engine.add_request("r", list(range(10, 50)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    assert _sample("weft_kv_blocks", executor=name, partition="default", state="used") >= 3
    assert _sample("weft_kv_blocks", executor=name, partition="default", state="borrowed") >= 3
    while engine.has_unfinished_requests:
        engine.step()
    rec = trace.pop("r")
    add_executor_spans(t, rec, t.start_ns, rec.chunks[-1][1], rec.chunks[-1][1] + 10, 40, 0, 4)
    spans = {s.name: s for s in t.finish()}
    order = ["executor.wait", "executor.prefill_chunk", "executor.first_token", "executor.decode"]
    assert [spans[n].start_ns for n in order] == sorted(spans[n].start_ns for n in order)
    assert spans["executor.wait"].end_ns == spans["executor.prefill"].start_ns
