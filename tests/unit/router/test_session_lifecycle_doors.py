"""Session lifecycle at both public doors (issue 17), through the real scheduler client and
an in-process scheduler with fake executors: ``DELETE /v1/weft/sessions/{id}`` and
``Router.EndSession`` end the caller's session (idempotent; another tenant's id is 404 /
NOT_FOUND), a second hop while one runs is 409 / ABORTED naming the session and the running
hop, and ``request_class: deterministic`` is greedy unless seeded (temperature > 0 without a
seed is 400 / INVALID_ARGUMENT naming the field)."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.mesh.grpc_server import GrpcServer
from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.scheduler_client import SchedulerClient
from services.router.server import ROUTER_ERROR_RULES, RouterServicer, add_router_to_server
from services.shared.tokenizer import Tokenizer
from tests.unit.scheduler.test_session_lifecycle import GatedExecutor, start_mesh
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

MODEL = "tiny"
KEYS = {"sk-a": "lifecycle-a", "sk-b": "lifecycle-b"}  # unique: the verdict tables are process-wide
A = {"Authorization": "Bearer sk-a"}
B = {"Authorization": "Bearer sk-b"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


class Doors:
    """Both doors over one scheduler client, and the fake executor behind them."""

    def __init__(self, http: TestClient, grpc_stub, executor: GatedExecutor, close) -> None:
        self.http, self.grpc, self.executor, self.close = http, grpc_stub, executor, close


async def open_doors(model_dir) -> Doors:
    executor = GatedExecutor("e")
    _, close_mesh, address = await start_mesh({"e": executor})
    tokenizer = Tokenizer.from_dir(model_dir)
    limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)
    client = SchedulerClient(address)
    generator = Generator(tokenizer, limits, client)
    keys = KeyStore(KEYS)
    http = TestClient(TestServer(HttpApi(generator, keys, MODEL, end_session=client.end_session).app(1 << 20)))
    await http.start_server()
    server = GrpcServer("weft.v1.Router", "127.0.0.1", 0, rules=ROUTER_ERROR_RULES)
    add_router_to_server(RouterServicer(generator, keys, MODEL, end_session=client.end_session), server.server)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    async def close():
        await channel.close()
        await server.server.stop(0)
        await http.close()
        await client.close()
        await close_mesh()
    return Doors(http, router_pb2_grpc.RouterStub(channel), executor, close)


def completion(hop_index: int = 0, session_id: str = "s", **extra) -> dict:
    return {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "session_id": session_id,
            "hop_index": hop_index, **extra}


def grpc_hop(hop_index: int = 0, session_id: str = "s", sampling=None, request_class=0) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        model=MODEL, token_ids=router_pb2.TokenIds(ids=[1, 2, 3]), sampling=sampling,
        session=common_pb2.SessionInfo(session_id=session_id, hop_index=hop_index, request_class=request_class))


def grpc_key(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def test_http_second_hop_while_one_runs_is_409_naming_the_session_and_the_next_hop_is_served(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            first = asyncio.ensure_future(doors.http.post("/v1/completions", json=completion(0), headers=A))
            for _ in range(500):  # wait on a condition: the first hop reached the executor
                if doors.executor.request_ids:
                    break
                await asyncio.sleep(0.01)
            busy = await doors.http.post("/v1/completions", json=completion(0), headers=A)
            busy_body = await busy.json()
            doors.executor.gate.set()
            first_status = (await first).status
            after = await doors.http.post("/v1/completions", json=completion(1), headers=A)
            return busy.status, busy_body, first_status, after.status, list(doors.executor.request_ids)
        finally:
            await doors.close()

    status, body, first_status, after_status, executed = asyncio.run(main())
    assert status == 409
    assert body["error"]["code"] == "session_busy" and body["error"]["param"] == "session_id"
    assert "'s'" in body["error"]["message"] and executed[0] in body["error"]["message"]
    assert (first_status, after_status) == (200, 200)
    assert len(executed) == 2  # the refused hop never reached an executor


def test_grpc_second_hop_while_one_runs_is_aborted_naming_the_session(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            first = doors.grpc.Generate(grpc_hop(0), metadata=grpc_key("sk-a"))
            await first.read()
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                _ = [r async for r in doors.grpc.Generate(grpc_hop(0), metadata=grpc_key("sk-a"))]
            doors.executor.gate.set()
            while await first.read() is not grpc.aio.EOF:
                pass
            after = [r async for r in doors.grpc.Generate(grpc_hop(1), metadata=grpc_key("sk-a"))]
            return busy.value, after, list(doors.executor.request_ids)
        finally:
            await doors.close()

    busy, after, executed = asyncio.run(main())
    assert busy.code() == grpc.StatusCode.ABORTED
    assert "'s'" in busy.details() and executed[0] in busy.details()
    assert after[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


def test_http_delete_ends_own_session_idempotently_and_another_tenants_id_is_404(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        doors.executor.gate.set()
        try:
            assert (await doors.http.post("/v1/completions", json=completion(0), headers=A)).status == 200
            theirs = await doors.http.delete("/v1/weft/sessions/s", headers=B)
            released_after_theirs = list(doors.executor.released)
            unknown = await doors.http.delete("/v1/weft/sessions/never", headers=A)
            no_key = await doors.http.delete("/v1/weft/sessions/s")
            mine = await doors.http.delete("/v1/weft/sessions/s", headers=A)
            again = await doors.http.delete("/v1/weft/sessions/s", headers=A)
            stateful = await doors.http.post("/v1/completions", headers=A,
                                             json=completion(1, session_stateful=True))
            return (theirs.status, (await theirs.json())["error"]["code"], released_after_theirs, unknown.status,
                    no_key.status, mine.status, await mine.json(), await again.json(), stateful.status,
                    list(doors.executor.released))
        finally:
            await doors.close()

    (theirs, code, released_after_theirs, unknown, no_key, mine, mine_body, again_body, stateful,
     released) = asyncio.run(main())
    assert (theirs, code, released_after_theirs) == (404, "session_not_found", [])
    assert (unknown, no_key, mine) == (404, 401, 200)
    assert (mine_body["ended_now"], mine_body["num_executors_released"]) == (True, 1)
    assert again_body["ended"] and not again_body["ended_now"]
    assert stateful == 400  # its context is gone: a stateful hop cannot continue it
    assert released[0] == "lifecycle-a/s"


def test_grpc_end_session_ends_own_and_another_tenants_id_is_not_found(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        doors.executor.gate.set()
        try:
            _ = [r async for r in doors.grpc.Generate(grpc_hop(0), metadata=grpc_key("sk-a"))]
            with pytest.raises(grpc.aio.AioRpcError) as theirs:
                await doors.grpc.EndSession(router_pb2.EndSessionRequest(session_id="s"), metadata=grpc_key("sk-b"))
            mine = await doors.grpc.EndSession(router_pb2.EndSessionRequest(session_id="s"), metadata=grpc_key("sk-a"))
            again = await doors.grpc.EndSession(router_pb2.EndSessionRequest(session_id="s"), metadata=grpc_key("sk-a"))
            with pytest.raises(grpc.aio.AioRpcError) as no_key:
                await doors.grpc.EndSession(router_pb2.EndSessionRequest(session_id="s"))
            return theirs.value, mine, again, no_key.value
        finally:
            await doors.close()

    theirs, mine, again, no_key = asyncio.run(main())
    assert theirs.code() == grpc.StatusCode.NOT_FOUND
    assert (mine.session_id, mine.ended_now, mine.num_executors_released) == ("s", True, 1)
    assert not again.ended_now
    assert no_key.code() == grpc.StatusCode.UNAUTHENTICATED


def test_deterministic_is_greedy_unless_seeded_and_a_sampled_one_is_refused_naming_the_field(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        doors.executor.gate.set()
        det = {"request_class": "deterministic"}
        try:
            refused = await doors.http.post("/v1/completions", headers=A,
                                            json=completion(0, "", temperature=1.0, **det))
            greedy = await doors.http.post("/v1/completions", headers=A, json=completion(0, "", **det))
            seeded = await doors.http.post("/v1/completions", headers=A,
                                           json=completion(0, "", temperature=0.7, seed=5, **det))
            with pytest.raises(grpc.aio.AioRpcError) as grpc_refused:
                _ = [r async for r in doors.grpc.Generate(
                    grpc_hop(0, "", common_pb2.SamplingParams(temperature=1.0),
                             common_pb2.REQUEST_CLASS_DETERMINISTIC), metadata=grpc_key("sk-a"))]
            _ = [r async for r in doors.grpc.Generate(
                grpc_hop(0, "", None, common_pb2.REQUEST_CLASS_DETERMINISTIC), metadata=grpc_key("sk-a"))]
            return (refused.status, await refused.json(), greedy.status, seeded.status, grpc_refused.value,
                    [s.temperature for s in doors.executor.samplings])
        finally:
            await doors.close()

    refused, body, greedy, seeded, grpc_refused, temperatures = asyncio.run(main())
    assert (refused, body["error"]["param"]) == (400, "temperature")
    assert (greedy, seeded) == (200, 200)
    assert grpc_refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.temperature" in grpc_refused.details()
    assert temperatures == [0.0, pytest.approx(0.7), 0.0]  # unset: greedy; seeded: as asked


def test_a_session_hop_of_several_prompts_or_more_branches_than_a_fork_takes_is_refused_naming_the_field(
        model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            n17 = await doors.http.post("/v1/completions", headers=A, json=completion(0, n=17))
            prompts = await doors.http.post("/v1/completions", headers=A,
                                            json={**completion(0), "prompt": [[1, 2], [3, 4]]})
            with pytest.raises(grpc.aio.AioRpcError) as grpc_n17:
                _ = [r async for r in doors.grpc.Generate(grpc_hop(0, "s", common_pb2.SamplingParams(n=17)),
                                                          metadata=grpc_key("sk-a"))]
            return (await n17.json())["error"]["param"], (await prompts.json())["error"]["param"], grpc_n17.value
        finally:
            await doors.close()

    n17, prompts, grpc_n17 = asyncio.run(main())
    assert (n17, prompts) == ("n", "prompt")
    assert grpc_n17.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.n" in grpc_n17.details()
