"""Router intent pre-screen and the session / contract extension fields."""
from __future__ import annotations

import time

import pytest

from services.router.errors import InvalidRequestError
from services.router.intent import IntentFeatures, classify, prescreen
from services.router.schema import ContractSpec, Session
from services.router.validation import _session


def _f(**kw) -> IntentFeatures:
    base = dict(declared_class="", has_session=False, hop_index=0, has_tools=False, num_prompt_tokens=100,
                max_tokens=100)
    base.update(kw)
    return IntentFeatures(**base)


def test_prescreen_classes_from_cheap_features():
    assert classify(_f()) == "interactive"
    assert classify(_f(has_session=True)) == "agentic"
    assert classify(_f(has_tools=True)) == "agentic"
    assert classify(_f(num_prompt_tokens=10_000, max_tokens=2000)) == "batch"
    assert classify(_f(declared_class="deterministic", has_tools=True)) == "deterministic"
    assert classify(_f(tenant_default_class="batch")) == "batch"


def test_prescreen_fills_only_the_contract_fields_left_at_zero_and_is_well_under_a_millisecond():
    s = prescreen(Session(contract=ContractSpec(ttft_ceiling_ms=300)), False, 50, 16)
    assert s.request_class == "interactive" and s.contract.ttft_ceiling_ms == 300 and s.contract.fallback == "reroute"
    agent = prescreen(Session(session_id="s"), True, 50, 16)
    assert agent.request_class == "agentic" and agent.contract.fallback == "degrade"
    start = time.perf_counter()
    for _ in range(1000):
        prescreen(Session(session_id="s", hop_index=3), True, 5000, 256)
    assert (time.perf_counter() - start) / 1000 < 1e-3


@pytest.mark.parametrize("body,field", [
    ({"expected_tool_ms": -5}, "expected_tool_ms"),
    ({"session_stateful": True}, "session_stateful"),
    ({"request_class": "urgent"}, "request_class"),
    ({"contract": {"kv_quota_blocks": -1}}, "contract.kv_quota_blocks"),
    ({"contract": {"fallback": "pray"}}, "contract.fallback"),
    ({"contract": []}, "contract"),
])
def test_bad_session_fields_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as err:
        _session(body)
    assert err.value.field == field


def test_session_fields_parse_stateful_mode_and_the_contract():
    s = _session({"session_id": "s", "session_stateful": True, "hop_index": 2, "request_class": "agentic",
                  "contract": {"kv_quota_blocks": 64, "ttft_ceiling_ms": 500, "fallback": "fail_fast"}})
    assert s.stateful and s.hop_index == 2 and s.contract == ContractSpec(64, 500, 0, "fail_fast")


def test_scheduler_decisions_become_response_headers():
    from services.router.http_api import notes_headers
    from services.router.scheduler_client import from_proto
    from services.router.schema import ServingNotes
    from weft.v1 import common_pb2, scheduler_pb2

    first = from_proto(scheduler_pb2.ScheduleResponse(
        request_class=common_pb2.REQUEST_CLASS_INTERACTIVE, fallback_taken=common_pb2.FALLBACK_PATH_REROUTE,
        fallback_reason="ttft estimate 900 ms > ceiling 500 ms")).notes
    last = from_proto(scheduler_pb2.ScheduleResponse(pause_decision=common_pb2.PAUSE_DECISION_KEEP)).notes
    assert first == ServingNotes("interactive", "reroute", "ttft estimate 900 ms > ceiling 500 ms", "")
    assert notes_headers(first, last) == {
        "x-weft-request-class": "interactive", "x-weft-fallback": "reroute",
        "x-weft-fallback-reason": "ttft estimate 900 ms > ceiling 500 ms", "x-weft-pause": "keep"}
    assert from_proto(scheduler_pb2.ScheduleResponse()).notes is None and notes_headers(None, None) == {}
