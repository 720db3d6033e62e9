"""A contract's accepted degradation steps, end to end without processes: the router's
HTTP validation (400 naming the field on an unknown rung), the proto the scheduler gets,
the scheduler's DegradationContract, the DEGRADE fallback choosing an offered rung, and
the served rung surfacing as a response header."""
from __future__ import annotations

import pytest

from services.router.errors import InvalidRequestError
from services.router.http_api import notes_headers
from services.router.scheduler_client import from_proto, to_proto
from services.router.schema import ContractSpec, Sampling, Session, TokenRequest
from services.router.session_fields import _contract
from services.scheduler.policy.contracts import ContractBook, ContractTerms, Fallback
from services.scheduler.policy.degradation import DegradationContract, Rung
from services.scheduler.errors import InvalidScheduleRequest
from services.scheduler.api.convert import degradation_contract
from tests.unit.router.test_http import MODEL, _client, run
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, scheduler_pb2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL)


def test_accepted_steps_are_parsed_deduplicated_and_default_to_none_listed():
    assert _contract({"accepted_degrade_steps": ["kv_int8", "kv_compress", "kv_int8"]}).accepted_degrade_steps == (
        "kv_int8", "kv_compress")
    assert _contract({}).accepted_degrade_steps == ()
    assert _contract({"accepted_degrade_steps": None}).accepted_degrade_steps == ()


@pytest.mark.parametrize("value, field", [
    (["kv_int8", "turbo"], "contract.accepted_degrade_steps[1]"),
    ("kv_int8", "contract.accepted_degrade_steps"),
    ([3], "contract.accepted_degrade_steps[0]"),
])
def test_bad_accepted_steps_are_refused_naming_the_field(value, field):
    with pytest.raises(InvalidRequestError) as info:
        _contract({"accepted_degrade_steps": value})
    assert info.value.field == field


def test_an_unknown_rung_name_is_a_400_naming_the_field_over_http(model_dir):
    async def go():
        client, fake = await _client(model_dir)
        try:
            messages = [{"role": "user", "content": "hi"}]
            resp = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "contract": {"accepted_degrade_steps": ["kv_int4"]}})
            err = await resp.json()
            assert resp.status == 400, err
            assert err["error"]["param"] == "contract.accepted_degrade_steps[0]"
            assert "kv_int4" in err["error"]["message"]
            ok = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": 2,
                "contract": {"accepted_degrade_steps": ["kv_int8", "none"]}})
            assert ok.status == 200
            assert fake.requests[-1].session.contract.accepted_degrade_steps == ("kv_int8", "none")
        finally:
            await client.close()
    run(go())


def test_the_scheduler_builds_the_degradation_contract_from_the_proto():
    request = to_proto(TokenRequest("r", MODEL, (1, 2), Sampling(max_tokens=4), "t", Session(
        contract=ContractSpec(accepted_degrade_steps=("kv_compress",)))))
    contract = request.session.contract
    assert list(contract.accepted_degrade_steps) == [common_pb2.DEGRADE_STEP_KV_COMPRESS]
    assert degradation_contract(contract).accepted == {Rung.NONE, Rung.KV_COMPRESS, Rung.SHED}
    assert degradation_contract(common_pb2.Contract()) == DegradationContract()  # empty: every rung
    only_full = common_pb2.Contract(accepted_degrade_steps=[common_pb2.DEGRADE_STEP_NONE])
    assert degradation_contract(only_full).accepted == {Rung.NONE, Rung.SHED}
    with pytest.raises(InvalidScheduleRequest):
        degradation_contract(common_pb2.Contract(accepted_degrade_steps=[common_pb2.DEGRADE_STEP_UNSPECIFIED]))


def test_a_degrade_fallback_serves_on_the_lowest_accepted_offered_rung_and_says_which():
    book = ContractBook()
    tight = dict(interactive=False, num_ahead=50, num_slots=1, num_new_tokens=10)
    terms = ContractTerms(ttft_ceiling_ms=100, fallback=Fallback.DEGRADE)
    offered = {Rung.NONE, Rung.KV_COMPRESS, Rung.SMALLER_MODEL}
    choice = book.choose_fallback(terms, offered=offered, **tight)
    assert choice.path is Fallback.DEGRADE and choice.rung is Rung.KV_COMPRESS
    assert "served on the kv_compress rung" in choice.reason
    picky = ContractTerms(ttft_ceiling_ms=100, fallback=Fallback.DEGRADE,
                          degradation=DegradationContract.from_labels(["kv_int8"]))
    nothing = book.choose_fallback(picky, offered=offered, **tight)
    assert nothing.rung is Rung.NONE and "served at full quality" in nothing.reason
    assert book.choose_fallback(terms, **tight).rung is Rung.NONE  # no degraded pool at all


def test_the_served_rung_reaches_the_http_response_as_a_header():
    chunk = from_proto(scheduler_pb2.ScheduleResponse(
        request_id="r", token_ids_delta=[5], executor="executor-1",
        degradation_rung=common_pb2.DEGRADATION_RUNG_KV_INT8))
    assert chunk.degradation_rung == "kv_int8"
    assert notes_headers(chunk.notes, None)["x-weft-degradation-rung"] == "kv_int8"
