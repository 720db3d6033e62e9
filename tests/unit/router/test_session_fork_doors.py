"""Fork and join at both public doors (issue 17), through the real scheduler client and an
in-process scheduler with fake executors: ``POST /v1/weft/sessions/{id}/fork`` and
``/join``, ``Router.ForkSession`` and ``Router.JoinSession``. Children get default ids
``<id>.f<k>`` and run stateful hops at once; a join continues the parent from a child and
ends the rest. Refusals: another tenant's id 404 / NOT_FOUND, a child id in use 409
``session_exists``, a running parent 409 ``session_busy``, bad input 400 naming the door's
field. A session hop's ``n > 1`` runs on fork: test_session_hop_choices.py."""
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
from tests.unit.router.test_session_lifecycle_doors import Doors, completion, grpc_key
from tests.unit.scheduler.test_session_lifecycle import GatedExecutor, start_mesh
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

MODEL = "tiny"
KEYS = {"sk-a": "fork-a", "sk-b": "fork-b"}  # unique: the verdict tables are process-wide
A = {"Authorization": "Bearer sk-a"}
B = {"Authorization": "Bearer sk-b"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


async def open_doors(model_dir, gate_open: bool = True) -> Doors:
    executor = GatedExecutor("e")
    if gate_open:
        executor.gate.set()
    _, close_mesh, address = await start_mesh({"e": executor})
    tokenizer = Tokenizer.from_dir(model_dir)
    limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)
    client = SchedulerClient(address)
    generator = Generator(tokenizer, limits, client)
    keys = KeyStore(KEYS)
    http = TestClient(TestServer(HttpApi(generator, keys, MODEL, sessions=client).app(1 << 20)))
    await http.start_server()
    server = GrpcServer("weft.v1.Router", "127.0.0.1", 0, rules=ROUTER_ERROR_RULES)
    add_router_to_server(RouterServicer(generator, keys, MODEL, sessions=client), server.server)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    async def close():
        await channel.close()
        await server.server.stop(0)
        await http.close()
        await client.close()
        await close_mesh()
    return Doors(http, router_pb2_grpc.RouterStub(channel), executor, close)


def stateful(session_id: str, hop_index: int) -> dict:
    return completion(hop_index, session_id, prompt=[4], session_stateful=True)


async def answer(resp) -> tuple[int, dict]:
    return resp.status, await resp.json()


def test_http_fork_runs_children_at_once_and_join_continues_from_one(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            http = doors.http
            assert (await http.post("/v1/completions", json=completion(0, "p"), headers=A)).status == 200
            fork = await answer(await http.post("/v1/weft/sessions/p/fork", json={"n": 3}, headers=A))
            doors.executor.gate.clear()
            hops = [asyncio.ensure_future(http.post("/v1/completions", json=stateful(c, 1), headers=A))
                    for c in fork[1]["children"]]
            for _ in range(500):  # wait on a condition: all three children reached the executor
                if len(doors.executor.request_ids) == 4:
                    break
                await asyncio.sleep(0.01)
            running_together = len(doors.executor.request_ids)
            doors.executor.gate.set()
            statuses = [(await h).status for h in hops]
            join = await answer(await http.post("/v1/weft/sessions/p/join", json={"from": "p.f1"}, headers=A))
            after = await http.post("/v1/completions", json=stateful("p", 2), headers=A)
            ended = await http.post("/v1/completions", json=stateful("p.f0", 2), headers=A)
            return fork, running_together, statuses, join, after.status, ended.status
        finally:
            await doors.close()

    fork, running_together, statuses, join, after, ended = asyncio.run(main())
    assert fork[0] == 200
    assert fork[1] == {"id": "p", "object": "weft.session.fork", "children": ["p.f0", "p.f1", "p.f2"],
                       "num_context_tokens": 5}  # 3 prompt tokens + 2 output
    assert running_together == 4 and statuses == [200, 200, 200]  # no child was refused busy
    assert join[0] == 200
    assert join[1] == {"id": "p", "object": "weft.session.join", "from": "p.f1", "num_context_tokens": 8,
                       "ended_children": ["p.f0", "p.f2"]}
    assert after == 200  # hop 2: the child's hop index continues
    assert ended == 400  # an ended child's context is gone (session_id)


def test_http_refusals_name_the_field_and_another_tenants_session_is_404(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            http = doors.http
            await http.post("/v1/completions", json=completion(0, "p"), headers=A)
            await http.post("/v1/completions", json=completion(0, "taken"), headers=A)
            post = lambda path, body, h=A: http.post(f"/v1/weft/sessions/{path}", json=body, headers=h)  # noqa: E731
            return {
                "theirs": await answer(await post("p/fork", {"n": 1}, B)),
                "their_join": await answer(await post("p/join", {}, B)),
                "unknown": await answer(await post("nope/fork", {"n": 1})),
                "n0": await answer(await post("p/fork", {"n": 0})),
                "n17": await answer(await post("p/fork", {"n": 17})),
                "n_bool": await answer(await post("p/fork", {"n": True})),
                "none": await answer(await post("p/fork", {})),
                "dup": await answer(await post("p/fork", {"child_ids": ["a", "a"]})),
                "dot": await answer(await post("p/fork", {"child_ids": ["a", ".."]})),
                "exists": await answer(await post("p/fork", {"child_ids": ["a", "taken"]})),
                "from": await answer(await post("p/join", {"from": "taken"})),
                "end_children": await answer(await post("p/join", {"end_children": "yes"})),
                "key": (await post("p/fork", {"n": 1}, {})).status,
            }
        finally:
            await doors.close()

    out = asyncio.run(main())
    for key in ("theirs", "their_join", "unknown"):
        assert out[key][0] == 404 and out[key][1]["error"]["code"] == "session_not_found", key
    assert out["exists"][0] == 409
    assert out["exists"][1]["error"]["code"] == "session_exists" and "'taken'" in out["exists"][1]["error"]["message"]
    for key, param in (("n0", "n"), ("n17", "n"), ("n_bool", "n"), ("none", "n"), ("dup", "child_ids[1]"),
                       ("dot", "child_ids[1]"), ("from", "from"), ("end_children", "end_children")):
        assert out[key][0] == 400 and out[key][1]["error"]["param"] == param, (key, out[key])
    assert out["key"] == 401


def test_http_fork_of_a_running_session_is_409_session_busy(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            await doors.http.post("/v1/completions", json=completion(0, "p"), headers=A)
            doors.executor.gate.clear()
            running = asyncio.ensure_future(doors.http.post("/v1/completions", json=stateful("p", 1), headers=A))
            for _ in range(500):
                if len(doors.executor.request_ids) == 2:
                    break
                await asyncio.sleep(0.01)
            busy = await answer(await doors.http.post("/v1/weft/sessions/p/fork", json={"n": 2}, headers=A))
            doors.executor.gate.set()
            await running
            return busy
        finally:
            await doors.close()

    status, body = asyncio.run(main())
    assert status == 409 and body["error"]["code"] == "session_busy"


def test_grpc_fork_and_join_and_their_refusals(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            hop = router_pb2.GenerateRequest(model=MODEL, token_ids=router_pb2.TokenIds(ids=[1, 2, 3]),
                                             session=common_pb2.SessionInfo(session_id="p"))
            _ = [r async for r in doors.grpc.Generate(hop, metadata=grpc_key("sk-a"))]
            fork = await doors.grpc.ForkSession(router_pb2.ForkSessionRequest(session_id="p", num_children=2),
                                                metadata=grpc_key("sk-a"))
            errors = {}
            for name, call in {
                "theirs": doors.grpc.ForkSession(router_pb2.ForkSessionRequest(session_id="p", num_children=1),
                                                 metadata=grpc_key("sk-b")),
                "n": doors.grpc.ForkSession(router_pb2.ForkSessionRequest(session_id="p"), metadata=grpc_key("sk-a")),
                "ids": doors.grpc.ForkSession(router_pb2.ForkSessionRequest(
                    session_id="p", child_session_ids=["q", "q"]), metadata=grpc_key("sk-a")),
                "exists": doors.grpc.ForkSession(router_pb2.ForkSessionRequest(session_id="p", num_children=1),
                                                 metadata=grpc_key("sk-a")),  # p.f0 is the first fork's child
                "from": doors.grpc.JoinSession(router_pb2.JoinSessionRequest(session_id="p", from_session_id="zz"),
                                               metadata=grpc_key("sk-a")),
            }.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                errors[name] = err.value
            join = await doors.grpc.JoinSession(router_pb2.JoinSessionRequest(session_id="p", end_children=True),
                                                metadata=grpc_key("sk-a"))
            return fork, errors, join
        finally:
            await doors.close()

    fork, errors, join = asyncio.run(main())
    assert list(fork.child_session_ids) == ["p.f0", "p.f1"] and fork.num_context_tokens == 5
    assert errors["theirs"].code() == grpc.StatusCode.NOT_FOUND
    assert errors["exists"].code() == grpc.StatusCode.ALREADY_EXISTS and "'p.f0'" in errors["exists"].details()
    for name, field in (("n", "num_children"), ("ids", "child_session_ids[1]"), ("from", "from_session_id")):
        assert errors[name].code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert errors[name].details().startswith(f"{field}: "), (name, errors[name].details())
    assert sorted(join.ended_session_ids) == ["p.f0", "p.f1"] and join.num_context_tokens == 5
