"""Issue 17, hostile client and unlucky operator against ``n > 1`` on a session hop (choice 0
on the session, choice i on the branch ``<id>.h<hop>.n<i>``, forked after hop 0), through the
real scheduler client and an in-process scheduler with a fake executor whose session table
the tests read.

Found: a branch was forked before the scheduler had accepted the hop, and nothing ended it
when the hop was refused (a wrong hop index, a grammar the executor cannot compile, a plain
hop that took the session between the fork and the hop), failed, or was left by its client
mid-stream: the branches stayed behind, ids the client never saw, and asking the same hop
again was 409 ``session_exists`` once per branch. A forked branch now lives only if its hop
finishes (``session_branches.end_unfinished_branches``). (A branch's own failure:
test_issue17_session_hop_branch_failures.py.)"""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.mesh.grpc_server import GrpcServer
from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.scheduler_client import SchedulerClient
from services.router.server import ROUTER_ERROR_RULES, RouterServicer, add_router_to_server
from services.scheduler.dispatch.agent_steps import AgentSteps
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_session_lifecycle_doors import completion, grpc_key
from tests.unit.scheduler import test_session_lifecycle as lifecycle
from tests.unit.scheduler.test_session_lifecycle import GatedExecutor, start_mesh
from tests.waiting import until
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

MODEL = "tiny"
KEYS = {"sk-a": "hop17-a", "sk-b": "hop17-b"}  # unique: the verdict tables are process-wide
A, B = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}
TENANT_A, TENANT_B = KEYS["sk-a"], KEYS["sk-b"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


class HostileExecutor(GatedExecutor):
    """One token, then ``gate`` before the last; records the hops cancelled under it, and
    refuses those whose request id ends with ``refuse_suffix`` ("" : every one) as an
    executor refuses a grammar it cannot compile."""

    def __init__(self) -> None:
        super().__init__("e")
        self.gate.set()
        self.cancelled: list[str] = []
        self.refuse_suffix: str | None = None

    async def Generate(self, request, context):
        if self.refuse_suffix is not None and request.request_id.endswith(self.refuse_suffix):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "grammar.json_schema: cannot compile")
        try:
            async for chunk in super().Generate(request, context):
                yield chunk
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


class Mesh:
    def __init__(self, http: TestClient, stub, executor: HostileExecutor, table) -> None:
        self.http, self.grpc, self.executor, self.table = http, stub, executor, table

    async def post(self, body: dict, headers=A, path: str = "/v1/completions") -> tuple[int, dict]:
        resp = await self.http.post(path, json=body, headers=headers)
        return resp.status, await resp.json()

    def left_behind(self, ids, tenant: str = TENANT_A) -> list[str]:
        """Those of ``ids`` the scheduler still records or runs a hop of."""
        return [i for i in ids if self.table.get(tenant, i) is not None or self.table.running_hop(tenant, i)]


@asynccontextmanager
async def mesh_doors(model_dir, monkeypatch, sessions_of=lambda client: client):
    """Both doors over one scheduler client (``sessions_of`` may wrap it for the doors' fork
    and end calls) and an in-process scheduler whose SessionTable is handed out."""
    agents = []

    def recorded(*args, **kwargs):
        agents.append(AgentSteps(*args, **kwargs))
        return agents[-1]
    monkeypatch.setattr(lifecycle, "AgentSteps", recorded)
    executor = HostileExecutor()
    _, close_mesh, address = await start_mesh({"e": executor})
    tokenizer = Tokenizer.from_dir(model_dir)
    client = SchedulerClient(address)
    generator = Generator(tokenizer, model_limits(model_dir, tokenizer, [MODEL], max_model_len=512), client)
    keys, sessions = KeyStore(KEYS), sessions_of(client)
    http = TestClient(TestServer(HttpApi(generator, keys, MODEL, sessions=sessions).app(1 << 20)))
    await http.start_server()
    server = GrpcServer("weft.v1.Router", "127.0.0.1", 0, rules=ROUTER_ERROR_RULES)
    add_router_to_server(RouterServicer(generator, keys, MODEL, sessions=sessions), server.server)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{await server.start()}")
    try:
        yield Mesh(http, router_pb2_grpc.RouterStub(channel), executor, agents[0].plane.sessions)
    finally:
        executor.gate.set()
        await channel.close()
        await server.server.stop(0)
        await http.close()
        await client.close()
        await close_mesh()


def sessions_of(body: dict) -> list[str]:
    return [c["weft"]["session_id"] for c in body["choices"]]


def grpc_hop(hop_index: int, session_id: str = "s", n: int = 3) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(model=MODEL, token_ids=router_pb2.TokenIds(ids=[1, 2, 3]),
                                      sampling=common_pb2.SamplingParams(n=n, max_tokens=2),
                                      session=common_pb2.SessionInfo(session_id=session_id, hop_index=hop_index))


BRANCHES_H1 = ["s.h1.n1", "s.h1.n2"]
JSON_OUT = {"response_format": {"type": "json_object"}}


@pytest.mark.parametrize("how", ["wrong_hop_index", "grpc_wrong_hop_index", "grammar_refused_everywhere"])
def test_a_hop_refused_or_failed_after_its_fork_leaves_no_branch_and_can_be_asked_again(model_dir, monkeypatch,
                                                                                         how):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))
            if how == "wrong_hop_index":  # the session expects hop 1
                refused = await mesh.post(completion(5, "s", n=3))
            elif how == "grpc_wrong_hop_index":
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [r async for r in mesh.grpc.Generate(grpc_hop(5), metadata=grpc_key("sk-a"))]
                refused = (err.value.code(), err.value.details())
            else:
                mesh.executor.refuse_suffix = ""
                refused = await mesh.post(completion(1, "s", n=3, **JSON_OUT))
            await until(lambda: not mesh.left_behind(["s.h5.n1", "s.h5.n2", *BRANCHES_H1])
                        and mesh.table.running_hop(TENANT_A, "s") is None, "the hop's branches to end")
            mesh.executor.refuse_suffix = None
            mesh.executor.gate.set()
            again = await mesh.post(completion(1, "s", n=3))
            return refused, again

    refused, again = asyncio.run(main())
    if how == "grpc_wrong_hop_index":
        assert refused[0] == grpc.StatusCode.INVALID_ARGUMENT and refused[1].startswith("session.hop_index: ")
    else:
        param = "session.hop_index" if how == "wrong_hop_index" else "response_format"
        assert refused[0] == 400 and refused[1]["error"]["param"] == param, refused
    # before the fix: 409 session_exists naming 's.h1.n1' (or the forked 's.h5.n*' stayed behind)
    assert again[0] == 200 and sessions_of(again[1]) == ["s", *BRANCHES_H1], again


async def read_all_choices(resp, num_choices: int) -> None:
    """Read an SSE stream until every choice has sent a chunk."""
    seen = set()
    async for line in resp.content:
        if line.startswith(b"data: {"):
            seen.update(c["index"] for c in json.loads(line[6:])["choices"])
        if len(seen) == num_choices:
            return


@pytest.mark.parametrize("door", ["http_stream", "grpc"])
def test_a_client_that_leaves_mid_hop_frees_the_session_and_ends_every_branch(model_dir, monkeypatch, door):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))
            mesh.executor.gate.clear()  # every choice sends one token, then waits
            if door == "http_stream":
                resp = await mesh.http.post("/v1/completions", json=completion(1, "s", n=3, stream=True), headers=A)
                await read_all_choices(resp, 3)
                resp.close()
            else:
                call = mesh.grpc.Generate(grpc_hop(1), metadata=grpc_key("sk-a"))
                seen = set()
                async for chunk in call:
                    seen.add(chunk.index)
                    if len(seen) == 3:
                        break
                call.cancel()
            await until(lambda: len(mesh.executor.cancelled) == 3, "all three hops cancelled at the executor")
            await until(lambda: not mesh.left_behind(BRANCHES_H1)
                        and mesh.table.running_hop(TENANT_A, "s") is None, "the session freed, the branches ended")
            mesh.executor.gate.set()
            return await mesh.post(completion(1, "s", n=3))  # the same hop, asked again

    again = asyncio.run(main())
    assert again[0] == 200 and sessions_of(again[1]) == ["s", *BRANCHES_H1], again


class PausedForks:
    """The scheduler client, with a pause between a fork and the hop that asked it."""

    def __init__(self, client: SchedulerClient) -> None:
        self.client = client
        self.forked, self.resume = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def fork_session(self, tenant, session_id, child_ids, or_new=None, *, fork_id=""):
        forked = await self.client.fork_session(tenant, session_id, child_ids, or_new, fork_id=fork_id)
        self.forked.set()
        await self.resume.wait()
        return forked


def test_a_plain_hop_that_takes_the_session_between_the_fork_and_the_hop_leaves_no_branch(model_dir, monkeypatch):
    forks = []

    async def main():
        async with mesh_doors(model_dir, monkeypatch, lambda c: forks.append(PausedForks(c)) or forks[-1]) as mesh:
            await mesh.post(completion(0, "s"))  # hop 0 forks nothing
            with_n = asyncio.ensure_future(mesh.post(completion(1, "s", n=3)))
            await forks[0].forked.wait()
            mesh.executor.gate.clear()
            plain = asyncio.ensure_future(mesh.post(completion(1, "s")))
            await until(lambda: mesh.table.running_hop(TENANT_A, "s"), "the plain hop runs")
            forks[0].resume.set()
            refused = await with_n
            behind = mesh.left_behind(BRANCHES_H1)
            mesh.executor.gate.set()
            return refused, behind, (await plain)[0], await mesh.post(completion(2, "s", n=3))

    refused, behind, plain, next_hop = asyncio.run(main())
    assert refused[0] == 409 and refused[1]["error"]["code"] == "session_busy", refused
    assert behind == []  # before the fix: both forked branches stayed, never run
    assert plain == 200
    assert next_hop[0] == 200 and sessions_of(next_hop[1]) == ["s", "s.h2.n1", "s.h2.n2"]


def test_two_hops_asking_n_of_one_session_at_once_one_wins_and_the_loser_forks_nothing(model_dir, monkeypatch):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))
            mesh.executor.gate.clear()
            hops = [asyncio.ensure_future(mesh.post(completion(1, "s", n=3))) for _ in range(2)]
            done, _ = await asyncio.wait(hops, return_when=asyncio.FIRST_COMPLETED)
            first_done = done.pop().result()  # the winner waits on the gate: this is the loser
            mesh.executor.gate.set()
            results = await asyncio.gather(*hops)
            children = list(mesh.table.get(TENANT_A, "s").child_ids)
            return first_done, results, children, await mesh.post(completion(2, "s", n=2))

    loser, results, children, next_hop = asyncio.run(main())
    assert loser[0] == 409 and loser[1]["error"]["code"] in ("session_exists", "session_busy"), loser
    assert sorted(r[0] for r in results) == [200, 409]
    winner = next(r for r in results if r[0] == 200)
    assert sessions_of(winner[1]) == ["s", *BRANCHES_H1]
    assert children == BRANCHES_H1  # one fork: the loser's was refused whole
    assert next_hop[0] == 200 and sessions_of(next_hop[1]) == ["s", "s.h2.n1"]


def test_a_session_named_like_a_branch_is_never_forked_over_and_the_refusal_touches_nothing(model_dir, monkeypatch):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))
            await mesh.post(completion(0, "s.h1.n1", prompt=[9, 9, 9, 9]))  # the client's own session
            taken = await mesh.post(completion(1, "s", n=3))
            own = mesh.table.get(TENANT_A, "s.h1.n1")
            state = (own.context_token_ids.tolist(), own.parent_id, mesh.table.get(TENANT_A, "s").child_ids)
            return taken, state, mesh.left_behind(["s.h1.n2"]), await mesh.post(completion(1, "s"))

    taken, (context, parent, children), behind, plain = asyncio.run(main())
    assert taken[0] == 409 and taken[1]["error"]["code"] == "session_exists"
    assert "'s.h1.n1'" in taken[1]["error"]["message"]
    assert context[:4] == [9, 9, 9, 9] and parent == "" and children == []  # untouched, all or nothing
    assert behind == []
    assert plain[0] == 200  # the session still expects hop 1


@pytest.mark.parametrize("n", [True, "2", 2.0, 0, -1, 1.5, [2]])
def test_a_malformed_n_on_a_session_hop_is_400_naming_n_and_forks_nothing(model_dir, monkeypatch, n):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))
            bad = await mesh.post(completion(1, "s", n=n))
            return bad, mesh.left_behind(BRANCHES_H1), mesh.table.get(TENANT_A, "s").child_ids

    bad, behind, children = asyncio.run(main())
    assert bad[0] == 400 and bad[1]["error"]["param"] == "n", bad
    assert behind == [] and children == []


def test_sixteen_completions_fork_fifteen_branches_and_the_id_limit_is_exact_at_both_doors(model_dir, monkeypatch):
    edge = "x" * 122  # "<edge>.h0.n9" is 128 characters, "<edge>.h0.n10" 129

    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))
            sixteen = await mesh.post(completion(1, "s", n=16))
            children = list(mesh.table.get(TENANT_A, "s").child_ids)
            fits = await mesh.post(completion(0, edge, n=10))
            over = await mesh.post(completion(0, edge, n=11))
            with pytest.raises(grpc.aio.AioRpcError) as grpc_over:
                _ = [r async for r in mesh.grpc.Generate(grpc_hop(0, edge + "y", n=10), metadata=grpc_key("sk-a"))]
            return sixteen, children, fits, over, grpc_over.value

    sixteen, children, fits, over, grpc_over = asyncio.run(main())
    expected = [f"s.h1.n{i}" for i in range(1, 16)]
    assert sixteen[0] == 200 and sessions_of(sixteen[1]) == ["s", *expected]
    assert children == expected
    assert fits[0] == 200 and sessions_of(fits[1])[-1] == edge + ".h0.n9"
    assert over[0] == 400 and over[1]["error"]["param"] == "n" and "shorter session id" in over[1]["error"]["message"]
    assert grpc_over.code() == grpc.StatusCode.INVALID_ARGUMENT and grpc_over.details().startswith("sampling.n: ")


def test_another_tenants_hop_with_n_on_the_same_id_neither_forks_nor_reads_nor_ends_the_session(
        model_dir, monkeypatch):
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "t", prompt=[1] * 20))  # A's context: 20 + 2 tokens
            out = {
                "b_stateful": await mesh.post(completion(1, "t", prompt=[4], n=2, session_stateful=True), B),
                "b_stateless": await mesh.post(completion(1, "t", prompt=[4], n=2), B),
                "a": await mesh.post(completion(1, "t", prompt=[4], n=2, session_stateful=True)),
                "b_join": await mesh.post({"from": "t.h1.n1"}, B, "/v1/weft/sessions/t/join"),
            }
            await mesh.http.delete("/v1/weft/sessions/t.h1.n1", headers=B)  # B's own branch
            out["a_branch"] = await mesh.post(completion(2, "t.h1.n1", prompt=[5], session_stateful=True))
            return out

    out = asyncio.run(main())
    assert out["b_stateful"][0] == 400 and out["b_stateful"][1]["error"]["param"] == "session.session_id"
    b = out["b_stateless"]
    assert b[0] == 200 and sessions_of(b[1]) == ["t", "t.h1.n1"]
    assert b[1]["usage"]["prompt_tokens"] == 1  # B's own prompt, none of A's context
    a = out["a"]
    assert a[0] == 200 and sessions_of(a[1]) == ["t", "t.h1.n1"]
    assert a[1]["usage"]["prompt_tokens"] == 23  # A's hop 1 (n = 2) continued A's context alone
    assert out["b_join"][0] == 400  # B's "t" has no children: B's branches are new sessions
    assert out["a_branch"][0] == 200 and out["a_branch"][1]["usage"]["prompt_tokens"] == 23 + 2 + 1


def test_a_stateful_chat_stream_with_n_names_each_branch_on_its_final_chunk_and_each_continues(
        model_dir, monkeypatch):
    def chat(hop_index, session_id, **extra):
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "session_id": session_id, "hop_index": hop_index, **extra}

    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            first = await mesh.post(chat(0, "c"), path="/v1/chat/completions")
            resp = await mesh.http.post("/v1/chat/completions", headers=A,
                                        json=chat(1, "c", n=3, stream=True, session_stateful=True))
            finals = {}
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        if c.get("finish_reason"):
                            finals[c["index"]] = (c.get("weft") or {}).get("session_id")
            nexts = [await mesh.post(chat(2, sid, session_stateful=True), path="/v1/chat/completions")
                     for sid in finals.values()]
            return first, finals, nexts

    first, finals, nexts = asyncio.run(main())
    assert first[0] == 200
    assert finals == {0: "c", 1: "c.h1.n1", 2: "c.h1.n2"}
    assert [n[0] for n in nexts] == [200, 200, 200]
    # each branch's hop 2 continued the same context: hop 0 + hop 1 (its own 2 tokens) + the new message
    assert len({n[1]["usage"]["prompt_tokens"] for n in nexts}) == 1
    assert nexts[0][1]["usage"]["prompt_tokens"] > first[1]["usage"]["prompt_tokens"] + 4
