"""Decisions visible at the router's doors (issue 17), through the real scheduler client and
an in-process scheduler with a fake executor: gRPC ``GenerateResponse.decisions`` (first
chunk: class, priority, rung, TTFT contract; last chunk: the pause), HTTP's ``weft`` object
on a finished choice (streamed: on the chunk carrying ``finish_reason``, with the pause the
stream's headers could not carry), a KV-quota cut reported as ``kv_quota`` (gRPC
FINISH_REASON_KV_QUOTA; the ``openai`` client parses it), the timeline's decision events,
and a continuation refused on the KV quota ending ``kv_quota`` rather than failing."""
from __future__ import annotations

import asyncio
import json

import grpc
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.mesh.grpc_server import GrpcServer
from services.router.auth import KeyStore
from services.router.continuation import ContinuingStreamer
from services.router.errors import InvalidRequestError
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.scheduler_client import SchedulerClient, from_proto
from services.router.server import ROUTER_ERROR_RULES, RouterServicer, add_router_to_server
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_continuation import FAST, ScriptedScheduler, collect, run
from tests.unit.scheduler.test_placement_rungs import FakeExecutor
from tests.unit.scheduler.test_session_lifecycle import start_mesh
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, executor_pb2, router_pb2, router_pb2_grpc, scheduler_pb2

MODEL = "tiny"
KEYS = {"sk-d": "decisions-d"}
AUTH = {"Authorization": "Bearer sk-d"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


class TwoTokens(FakeExecutor):
    """Two tokens, the second final with ``finish``."""

    def __init__(self, name: str, finish=common_pb2.FINISH_REASON_LENGTH) -> None:
        super().__init__(name)
        self.finish = finish

    async def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        n = len(request.prompt_token_ids)
        for i, finish in ((1, 0), (2, self.finish)):
            yield executor_pb2.ExecuteResponse(
                request_id=request.request_id, token_ids_delta=[6 + i], finish_reason=finish, executor=self.name,
                usage=common_pb2.Usage(num_prompt_tokens=n, num_output_tokens=i))

    async def ReleaseSession(self, request, context):
        return executor_pb2.ReleaseSessionResponse()


async def open_doors(model_dir, executor: FakeExecutor):
    _, close_mesh, address = await start_mesh({"e": executor})
    tokenizer = Tokenizer.from_dir(model_dir)
    client = SchedulerClient(address)
    generator = Generator(tokenizer, model_limits(model_dir, tokenizer, [MODEL], max_model_len=512), client)
    http = TestClient(TestServer(HttpApi(generator, KeyStore(KEYS), MODEL).app(1 << 20)))
    await http.start_server()
    server = GrpcServer("weft.v1.Router", "127.0.0.1", 0, rules=ROUTER_ERROR_RULES)
    add_router_to_server(RouterServicer(generator, KeyStore(KEYS), MODEL), server.server)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{await server.start()}")

    async def close():
        await channel.close()
        await server.server.stop(0)
        await http.close()
        await client.close()
        await close_mesh()
    return http, router_pb2_grpc.RouterStub(channel), close


def hop_body(**extra) -> dict:
    return {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5, "session_id": "s", "request_class": "agentic",
            "ttft_ceiling_ms": 10_000, **extra}


def test_grpc_first_chunk_carries_the_decisions_and_the_last_the_pause(model_dir):
    async def main():
        http, stub, close = await open_doors(model_dir, TwoTokens("e"))
        try:
            req = router_pb2.GenerateRequest(
                model=MODEL, token_ids=router_pb2.TokenIds(ids=[1, 2, 3]),
                session=common_pb2.SessionInfo(session_id="s", request_class=common_pb2.REQUEST_CLASS_AGENTIC,
                                               contract=common_pb2.Contract(ttft_ceiling_ms=600_000)))
            return [r async for r in stub.Generate(req, metadata=(("authorization", "Bearer sk-d"),))]
        finally:
            await close()

    out = asyncio.run(main())
    first, last = out[0].decisions, out[-1].decisions
    assert first.request_class == common_pb2.REQUEST_CLASS_AGENTIC
    assert first.degradation_rung == common_pb2.DEGRADATION_RUNG_NONE
    assert first.ttft_ceiling_ms == 600_000 and first.ttft_estimate_ms > 0 and first.priority < 0
    assert first.pause_decision == common_pb2.PAUSE_DECISION_UNSPECIFIED
    assert last.pause_decision == common_pb2.PAUSE_DECISION_KEEP


def test_http_weft_object_on_the_finished_choice_streamed_and_not_with_the_pause(model_dir):
    async def main():
        http, _, close = await open_doors(model_dir, TwoTokens("e"))
        try:
            whole = await (await http.post("/v1/completions", json=hop_body(), headers=AUTH)).json()
            resp = await http.post("/v1/completions", json=hop_body(stream=True, hop_index=1), headers=AUTH)
            events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                      if line.startswith("data: {")]
            return whole, events, resp.headers
        finally:
            await close()

    whole, events, headers = asyncio.run(main())
    weft = whole["choices"][0]["weft"]
    assert weft["request_class"] == "agentic" and weft["degradation_rung"] == "none"
    assert weft["pause_decision"] == "keep" and weft["ttft_ceiling_ms"] == 10_000
    assert isinstance(weft["ttft_achieved_ms"], int) and isinstance(weft["priority"], float)
    finished = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finished) == 1 and finished[0]["choices"][0]["weft"]["pause_decision"] == "keep"
    assert finished[0]["choices"][0]["weft"]["request_class"] == "agentic"  # first-chunk fields kept too
    assert all("weft" not in e["choices"][0] for e in events if e not in finished)
    assert headers["x-weft-request-class"] == "agentic"  # the headers stay


def test_a_kv_quota_cut_is_kv_quota_at_both_doors_and_the_openai_client_parses_it(model_dir):
    async def main():
        http, stub, close = await open_doors(model_dir, TwoTokens("e", common_pb2.FINISH_REASON_KV_QUOTA))
        try:
            grpc_out = [r async for r in stub.Generate(
                router_pb2.GenerateRequest(model=MODEL, token_ids=router_pb2.TokenIds(ids=[1, 2, 3])),
                metadata=(("authorization", "Bearer sk-d"),))]
            client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="sk-d", max_retries=0)
            chat = await client.chat.completions.create(model=MODEL, max_tokens=5,
                                                        messages=[{"role": "user", "content": "hi"}])
            await client.close()
            return grpc_out, chat
        finally:
            await close()

    grpc_out, chat = asyncio.run(main())
    assert grpc_out[-1].finish_reason == common_pb2.FINISH_REASON_KV_QUOTA
    assert chat.choices[0].finish_reason == "kv_quota"


def test_the_timeline_has_one_event_per_decision(model_dir):
    async def main():
        http, _, close = await open_doors(model_dir, TwoTokens("e"))
        try:
            resp = await http.post("/v1/completions", json=hop_body(), headers=AUTH)
            rid = resp.headers["x-request-id"]
            for _ in range(500):  # the router stores the timeline as the stream closes
                timeline = await http.get(f"/v1/weft/requests/{rid}/timeline", headers=AUTH)
                if timeline.status == 200:
                    return await timeline.json()
                await asyncio.sleep(0.01)
            raise AssertionError("no timeline")
        finally:
            await close()

    doc = asyncio.run(main())
    spans = {s["name"]: s["attrs"] for s in doc["spans"]}
    assert doc["decisions"]["pause"] == spans["scheduler.decision.pause"]  # by kind, too
    assert spans["scheduler.decision.admission"]["request_class"] == "agentic"
    assert spans["scheduler.decision.rung"]["rung"] == "none"
    ttft = spans["scheduler.decision.ttft"]
    assert ttft["ceiling_ms"] == 10_000 and ttft["outcome"] == ("met" if ttft["achieved_ms"] <= 10_000 else "missed")
    assert spans["scheduler.decision.pause"]["decision"] == "keep"


def test_the_scheduler_clients_chunk_reads_kv_quota_and_the_decisions():
    first = from_proto(scheduler_pb2.ScheduleResponse(
        token_ids_delta=[1], decisions=common_pb2.SchedulingDecisions(
            request_class=common_pb2.REQUEST_CLASS_BATCH, priority=-3.0, queue_ms=12, intent_shift=True,
            intent_distance=0.9, degradation_rung=common_pb2.DEGRADATION_RUNG_KV_INT8, ttft_achieved_ms=40)))
    last = from_proto(scheduler_pb2.ScheduleResponse(
        finish_reason=common_pb2.FINISH_REASON_KV_QUOTA,
        decisions=common_pb2.SchedulingDecisions(pause_decision=common_pb2.PAUSE_DECISION_DROP)))
    assert (first.notes.request_class, first.notes.priority, first.notes.queue_ms) == ("batch", -3.0, 12)
    assert first.notes.intent_shift and first.notes.degradation_rung == "kv_int8"
    assert first.notes.ttft_achieved_ms == 40
    assert last.finish_reason == "kv_quota" and last.notes.pause_decision == "drop"
    assert last.notes.priority is None  # the last chunk reports the pause only
    merged = first.notes.merged(last.notes)
    assert (merged.request_class, merged.pause_decision) == ("batch", "drop")


def test_a_continuation_refused_on_the_kv_quota_ends_kv_quota_not_an_error():
    fake = ScriptedScheduler([("lose", 3), ("refuse", InvalidRequestError(
        "session.contract.kv_quota_blocks", "7 tokens need 2 KV blocks, more than the task's quota of 1"))])
    chunks = run(collect(ContinuingStreamer(fake, FAST, fake.probe)))
    assert chunks[-1].finish_reason == "kv_quota" and chunks[-1].num_output_tokens == 3
