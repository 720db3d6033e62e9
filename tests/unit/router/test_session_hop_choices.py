"""``n > 1`` on a session hop (issue 17: "n > 1 can be built on" fork), at both public doors,
through the real scheduler client and an in-process scheduler with a fake executor.

Choice 0 runs on the session; choice i >= 1 runs the same hop on the branch session
``<id>.h<hop>.n<i>``: a fork of the session after hop 0 (its context, so a stateful hop's
new tokens continue it), a new session of the same program on hop 0. Each choice names its
session (HTTP ``choices[i].weft.session_id``, gRPC ``session_id`` on each index's first
chunk); the client continues on a branch or joins the session from it. Refusals: more than
16 completions, branch ids too long, several prompts, a branch id in use."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.unit.router.test_session_fork_doors import A, B, MODEL, answer, model_dir, open_doors  # noqa: F401
from tests.unit.router.test_session_lifecycle_doors import completion, grpc_key
from weft.v1 import common_pb2, router_pb2


def sessions_of(body: dict) -> list[str]:
    return [c["weft"]["session_id"] for c in body["choices"]]


def test_hop_0_with_n_runs_the_session_and_new_branch_sessions_each_continued_on_its_own(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            http = doors.http
            first = await answer(await http.post("/v1/completions", json=completion(0, "p", n=3), headers=A))
            on_branch = await http.post("/v1/completions", json=completion(1, "p.h0.n2", prompt=[4],
                                                                           session_stateful=True), headers=A)
            on_session = await http.post("/v1/completions", json=completion(1, "p", prompt=[4], session_stateful=True),
                                         headers=A)
            # hop 0's branches are new sessions, not children: join does not know them
            join = await answer(await http.post("/v1/weft/sessions/p/join", json={"from": "p.h0.n1"}, headers=A))
            return first, on_branch.status, on_session.status, join
        finally:
            await doors.close()

    first, on_branch, on_session, join = asyncio.run(main())
    assert first[0] == 200 and sessions_of(first[1]) == ["p", "p.h0.n1", "p.h0.n2"]
    assert [c["index"] for c in first[1]["choices"]] == [0, 1, 2]
    assert (on_branch, on_session) == (200, 200)  # each is its own session at hop 1
    assert join[0] == 400 and join[1]["error"]["param"] == "from"


def test_a_later_hop_with_n_forks_the_session_so_stateful_branches_continue_its_context_and_join_picks_one(
        model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            http = doors.http
            await http.post("/v1/completions", json=completion(0, "p"), headers=A)  # context [1, 2, 3] + 2 out
            hop = await answer(await http.post("/v1/completions", json=completion(1, "p", prompt=[4], n=3,
                                                                                  session_stateful=True), headers=A))
            join = await answer(await http.post("/v1/weft/sessions/p/join", json={"from": "p.h1.n2"}, headers=A))
            after = await http.post("/v1/completions", json=completion(2, "p", prompt=[5], session_stateful=True),
                                    headers=A)
            ended = await http.post("/v1/completions", json=completion(2, "p.h1.n1", prompt=[5], session_stateful=True),
                                    headers=A)
            return hop, join, after.status, ended.status
        finally:
            await doors.close()

    hop, join, after, ended = asyncio.run(main())
    assert hop[0] == 200 and sessions_of(hop[1]) == ["p", "p.h1.n1", "p.h1.n2"]
    assert join[0] == 200 and join[1]["from"] == "p.h1.n2" and join[1]["ended_children"] == ["p.h1.n1"]
    assert after == 200  # the session continues from the branch it joined
    assert ended == 400  # the other branch ended with the join


def test_grpc_names_each_choices_session_on_its_first_chunk_and_branches_share_the_sessions_context(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            stub, key = doors.grpc, grpc_key("sk-a")
            hop0 = router_pb2.GenerateRequest(model=MODEL, token_ids=router_pb2.TokenIds(ids=[1, 2, 3]),
                                              session=common_pb2.SessionInfo(session_id="g"))
            _ = [r async for r in stub.Generate(hop0, metadata=key)]
            hop1 = router_pb2.GenerateRequest(
                model=MODEL, token_ids=router_pb2.TokenIds(ids=[4]), sampling=common_pb2.SamplingParams(n=2),
                session=common_pb2.SessionInfo(session_id="g", hop_index=1, stateful=True))
            chunks = [r async for r in stub.Generate(hop1, metadata=key)]
            return chunks
        finally:
            await doors.close()

    chunks = asyncio.run(main())
    firsts = {}
    for c in chunks:
        firsts.setdefault(c.index, c.session_id)
    assert firsts == {0: "g", 1: "g.h1.n1"}
    later = [c.session_id for c in chunks if c.session_id and c is not next(x for x in chunks if x.index == c.index)]
    assert later == []  # on the first chunk of each index only
    # both branches generated from the session's whole context: 3 prompt + 2 output + 1 new token
    assert {c.index: c.usage.num_prompt_tokens for c in chunks if c.finish_reason} == {0: 6, 1: 6}


def test_refusals_name_the_field_and_another_tenants_hop_forks_nothing_of_the_session(model_dir):
    async def main():
        doors = await open_doors(model_dir)
        try:
            http = doors.http
            await http.post("/v1/completions", json=completion(0, "p"), headers=A)
            # a branch id in use: the same hop asked again once its branch exists
            await http.post("/v1/weft/sessions/p/fork", json={"child_ids": ["p.h1.n1"]}, headers=A)
            exists = await answer(await http.post("/v1/completions", json=completion(1, "p", n=2), headers=A))
            long_id = "x" * 125  # a valid id (<= 128), but "<id>.h0.n1" is not
            out = {
                "n17": await answer(await http.post("/v1/completions", json=completion(1, "p", n=17), headers=A)),
                "long": await answer(await http.post("/v1/completions", json=completion(0, long_id, n=2), headers=A)),
                "prompts": await answer(await http.post("/v1/completions", headers=A,
                                                        json={**completion(1, "p"), "prompt": [[1, 2], [3, 4]]})),
                "chat_n17": await answer(await http.post("/v1/chat/completions", headers=A, json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 17,
                    "session_id": "c", "hop_index": 0})),
                "exists": exists,
                # tenant B's "p" is B's own: unknown to the scheduler, so its branches start new
                "theirs": await answer(await http.post("/v1/completions", json=completion(1, "p", n=2), headers=B)),
                # A's session "p" is untouched by B: it still expects hop 1, and one is served
                "mine": await answer(await http.post("/v1/completions", json=completion(1, "p"), headers=A)),
            }
            with pytest.raises(grpc.aio.AioRpcError) as grpc_n17:
                hop = router_pb2.GenerateRequest(model=MODEL, token_ids=router_pb2.TokenIds(ids=[1]),
                                                 sampling=common_pb2.SamplingParams(n=17),
                                                 session=common_pb2.SessionInfo(session_id="p", hop_index=2))
                _ = [r async for r in doors.grpc.Generate(hop, metadata=grpc_key("sk-a"))]
            return out, grpc_n17.value
        finally:
            await doors.close()

    out, grpc_n17 = asyncio.run(main())
    for key, param in (("n17", "n"), ("long", "n"), ("prompts", "prompt"), ("chat_n17", "n")):
        assert out[key][0] == 400 and out[key][1]["error"]["param"] == param, (key, out[key])
    assert "at most 16" in out["n17"][1]["error"]["message"]
    assert "shorter session id" in out["long"][1]["error"]["message"]
    assert out["exists"][0] == 409 and out["exists"][1]["error"]["code"] == "session_exists"
    assert out["exists"][1]["error"]["param"] == "n"  # the field that chose the branch ids, not fork's child_ids
    assert "'p.h1.n1'" in out["exists"][1]["error"]["message"]
    assert out["theirs"][0] == 200 and sessions_of(out["theirs"][1]) == ["p", "p.h1.n1"]
    assert out["mine"][0] == 200
    assert grpc_n17.code() == grpc.StatusCode.INVALID_ARGUMENT and grpc_n17.details().startswith("sampling.n: ")
