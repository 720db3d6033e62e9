"""Issue 17, hostile client against session lifecycle: one hop of a session at a time must
hold against ids a client chooses (the same request id twice, an id shaped like the router's
own resend ``<id>.c<k>``) and against a hop cancelled while it waits in the scored queue;
DELETE /v1/weft/sessions/{id} must end exactly the caller's session whatever the id holds
(an encoded slash, unicode, path traversal, NUL)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.scheduler.dispatch.agent_steps import AgentSteps
from services.scheduler.policy.admission import Admission
from services.scheduler.state.sessions import SessionBusyError, SessionTable, executor_session_id
from tests.unit.router.test_session_lifecycle_doors import A, B, completion, grpc_key, open_doors
from tests.unit.scheduler import test_session_lifecycle as lifecycle
from tests.unit.scheduler.test_session_lifecycle import GatedExecutor, hop, start_mesh
from tests.waiting import until
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, executor_pb2, router_pb2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_tiny_checkpoint(path)
    return path


def test_one_request_id_sent_twice_cannot_run_two_hops_of_a_session():
    table = SessionTable()
    table.claim("t", "s", "t/job")
    with pytest.raises(SessionBusyError):
        table.claim("t", "s", "t/job")
    table.claim("t", "s", "t/job.c1")  # the router's resend of the running hop takes over
    with pytest.raises(SessionBusyError):
        table.claim("t", "s", "t/job.c1")
    with pytest.raises(SessionBusyError):
        table.claim("t", "s", "t/job")  # an older attempt never takes the claim back


def test_scheduler_refuses_a_second_stream_under_the_running_hops_request_id():
    fake = GatedExecutor("e")

    async def main():
        stub, close, _ = await start_mesh({"e": fake})
        try:
            first = stub.Generate(hop("t/job", hop_index=0))
            await first.read()
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                _ = [r async for r in stub.Generate(hop("t/job", hop_index=0))]
            fake.gate.set()
            while await first.read() is not grpc.aio.EOF:
                pass
            return busy.value.code(), len(fake.request_ids)
        finally:
            await close()

    code, num_executed = asyncio.run(main())
    assert code == grpc.StatusCode.ABORTED
    assert num_executed == 1


def test_http_client_id_shaped_like_a_resend_cannot_take_the_running_hops_claim(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            first = asyncio.ensure_future(doors.http.post(
                "/v1/completions", json=completion(0), headers={**A, "x-request-id": "job"}))
            await until(lambda: doors.executor.request_ids, "the first hop reached the executor")
            second = await doors.http.post("/v1/completions", json=completion(0),
                                           headers={**A, "x-request-id": "job.c1"})
            doors.executor.gate.set()
            await first
            return second.status, second.headers.get("x-request-id"), len(doors.executor.request_ids)
        finally:
            await doors.close()

    status, used_id, num_executed = asyncio.run(main())
    assert status == 409
    assert used_id != "job.c1"  # replaced, as a malformed id is
    assert num_executed == 1


def test_a_hop_cancelled_while_queued_leaves_its_session_free(monkeypatch):
    admissions = []

    def recorded(*args, **kwargs):
        admissions.append(Admission(*args, **kwargs))
        return admissions[-1]
    monkeypatch.setattr(lifecycle, "Admission", recorded)
    fake = GatedExecutor("e")

    async def main():
        stub, close, _ = await start_mesh({"e": fake})
        try:
            running = [stub.Generate(hop(f"t/fill-{i}", session_id=f"fill-{i}")) for i in range(8)]  # 8 slots
            for call in running:
                await call.read()
            queued = stub.Generate(hop("t/waits", session_id="s"))
            queued_read = asyncio.ensure_future(queued.read())
            await until(lambda: admissions[0].num_queued == 1, "the hop waits in the scored queue")
            queued.cancel()
            await until(lambda: admissions[0].num_queued == 0, "the cancelled waiter left the queue")
            fake.gate.set()
            for call in running:
                while await call.read() is not grpc.aio.EOF:
                    pass
            after = [r async for r in stub.Generate(hop("t/next", session_id="s"))]
            queued_read.cancel()
            return after
        finally:
            await close()

    after = asyncio.run(main())
    assert after and after[-1].finish_reason


class SilentExecutor(GatedExecutor):
    """Waits for ``gate`` before its first token; with ``die`` set it then fails UNAVAILABLE."""

    def __init__(self, name: str, die: bool = False) -> None:
        super().__init__(name)
        self.die = die

    async def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        await self.gate.wait()
        if self.die:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "executor died")
        yield executor_pb2.ExecuteResponse(
            request_id=request.request_id, token_ids_delta=[8], finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=1),
            executor=self.name)


@pytest.mark.parametrize("how", ["cancel_mid_stream", "cancel_before_first_token", "executor_dies"])
def test_a_hop_that_ends_badly_frees_its_session_for_the_next_hop(monkeypatch, how):
    agents = []

    def recorded(*args, **kwargs):
        agents.append(AgentSteps(*args, **kwargs))
        return agents[-1]
    monkeypatch.setattr(lifecycle, "AgentSteps", recorded)
    fake = GatedExecutor("e") if how == "cancel_mid_stream" else SilentExecutor("e", die=how == "executor_dies")

    async def main():
        stub, close, _ = await start_mesh({"e": fake})
        sessions = agents[0].plane.sessions
        try:
            first = stub.Generate(hop("t/first", session_id="s"))
            if how == "cancel_mid_stream":
                await first.read()
                first.cancel()
            else:
                read = asyncio.ensure_future(first.read())
                await until(lambda: fake.request_ids, "the hop reached the executor")
                if how == "executor_dies":
                    fake.gate.set()
                    with pytest.raises(grpc.aio.AioRpcError):
                        await read
                else:
                    first.cancel()
            await until(lambda: sessions.running_hop("t", "s") is None, "the hop's claim was released")
            fake.gate.set()
            fake.die = False
            after = [r async for r in stub.Generate(hop("t/next", session_id="s"))]
            return after, dict(agents[0]._plans)
        finally:
            await close()

    after, live_plans = asyncio.run(main())
    assert after[-1].finish_reason
    assert live_plans == {}


def test_http_delete_ends_exactly_the_callers_session_whatever_its_id_holds(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        doors.executor.gate.set()
        try:
            for sid in ("a/b", "é", "../health"):
                assert (await doors.http.post("/v1/completions", json=completion(0, sid), headers=A)).status == 200
            dots = [(await doors.http.post("/v1/completions", json=completion(0, sid), headers=A)).status
                    for sid in (".", "..")]
            theirs = await doors.http.delete("/v1/weft/sessions/a%2Fb", headers=B)
            ended = {path: (await doors.http.delete(f"/v1/weft/sessions/{path}", headers=A)).status
                     for path in ("a%2Fb", "%C3%A9", "..%2Fhealth")}
            nul = await doors.http.delete("/v1/weft/sessions/%00", headers=A)
            return dots, theirs.status, ended, (await nul.json())["error"]["param"], list(doors.executor.released)
        finally:
            await doors.close()

    dots, theirs, ended, nul_param, released = asyncio.run(main())
    assert dots == [400, 400]  # a URL cannot name them, so no session may be called so
    assert theirs == 404
    assert ended == {"a%2Fb": 200, "%C3%A9": 200, "..%2Fhealth": 200}
    assert nul_param == "session_id"
    assert released == ["lifecycle-a/a/b", "lifecycle-a/é", "lifecycle-a/../health"]


def test_a_tenant_named_with_a_slash_cannot_reach_another_tenants_pins_through_a_session_id():
    assert executor_session_id("acme", "x/y") != executor_session_id("acme/x", "y")
    assert executor_session_id("acme", "s") == "acme/s"  # plain tenant names keep their form
    assert executor_session_id("a%2Fb", "s") != executor_session_id("a/b", "s")


def test_grpc_client_id_shaped_like_a_resend_cannot_take_the_running_hops_claim(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            first = doors.grpc.Generate(router_pb2.GenerateRequest(
                model="tiny", request_id="job", token_ids=router_pb2.TokenIds(ids=[1, 2, 3]),
                session=common_pb2.SessionInfo(session_id="s")), metadata=grpc_key("sk-a"))
            await first.read()
            second = doors.grpc.Generate(router_pb2.GenerateRequest(
                model="tiny", request_id="job.c1", token_ids=router_pb2.TokenIds(ids=[1, 2, 3]),
                session=common_pb2.SessionInfo(session_id="s")), metadata=grpc_key("sk-a"))
            try:
                await second.read()  # admitted: the executor's first token comes at once
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            doors.executor.gate.set()
            for call in (first, second) if code == grpc.StatusCode.OK else (first,):
                while await call.read() is not grpc.aio.EOF:
                    pass
            return code, len(doors.executor.request_ids)
        finally:
            await doors.close()

    code, num_executed = asyncio.run(main())
    assert code != grpc.StatusCode.OK and num_executed == 1
