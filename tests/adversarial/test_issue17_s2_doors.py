"""Issue 17 (session 2), fork and join at the public doors against a hostile client: every
malformed count or id is a 400 naming the door's field (never a 500, never a fork); a gRPC
fork sending both a count and ids is refused as HTTP's is (the count was silently ignored);
a child id that is another tenant's session id makes a session of the caller's own and
never touches the other tenant's context or pins."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tests.unit.router.test_session_fork_doors import A, B, KEYS, completion, model_dir, open_doors  # noqa: F401
from weft.v1 import router_pb2

FORK = "/v1/weft/sessions/p/fork"


@pytest.mark.parametrize("body, field", [
    ({"n": 10**9}, "n"), ({"n": 10**400}, "n"), ({"n": "3"}, "n"), ({"n": 2.0}, "n"), ({"n": True}, "n"),
    ({"n": -1}, "n"), ({}, "n"), ({"n": 1, "child_ids": ["z"]}, "n"),
    ({"child_ids": [str(i) for i in range(17)]}, "child_ids"), ({"child_ids": {"a": 1}}, "child_ids"),
    ({"child_ids": [["a"]]}, "child_ids[0]"), ({"child_ids": ["ok", "a\u0000b"]}, "child_ids[1]"),
    ({"child_ids": ["\ud800"]}, "child_ids[0]"), ({"child_ids": [".."]}, "child_ids[0]"),
    ({"child_ids": ["x" * 129]}, "child_ids[0]"), ({"child_ids": ["p"]}, "child_ids[0]"),
])
def test_a_malformed_fork_is_a_400_naming_the_field_and_forks_nothing(model_dir, body, field):  # noqa: F811
    async def main():
        doors = await open_doors(model_dir)
        try:
            assert (await doors.http.post("/v1/completions", json=completion(0, "p"), headers=A)).status == 200
            bad = await doors.http.post(FORK, data=json.dumps(body), headers={**A, "Content-Type": "application/json"})
            after = await doors.http.post(FORK, json={"n": 1}, headers=A)  # p.f0 was not created by the refusal
            return bad.status, await bad.json(), after.status
        finally:
            await doors.close()

    status, answer, after = asyncio.run(main())
    assert status == 400 and answer["error"]["param"] == field, answer
    assert after == 200


def test_a_grpc_fork_with_both_a_count_and_ids_is_refused_naming_num_children(model_dir):  # noqa: F811
    async def main():
        doors = await open_doors(model_dir)
        try:
            assert (await doors.http.post("/v1/completions", json=completion(0, "p"), headers=A)).status == 200
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await doors.grpc.ForkSession(router_pb2.ForkSessionRequest(
                    session_id="p", num_children=2, child_session_ids=["z"]), metadata=(("authorization", "Bearer sk-a"),))
            return err.value
        finally:
            await doors.close()

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("num_children: ")


def test_a_child_named_like_another_tenants_session_never_touches_it(model_dir):  # noqa: F811
    async def main():
        doors = await open_doors(model_dir)
        try:
            http = doors.http
            assert (await http.post("/v1/completions", json=completion(0, "p"), headers=A)).status == 200
            assert (await http.post("/v1/completions", json=completion(0, "q"), headers=B)).status == 200
            fork = await http.post(FORK, json={"child_ids": ["q"]}, headers=A)
            joined = await http.post("/v1/weft/sessions/p/join", json={"from": "q"}, headers=A)
            ended = await http.delete("/v1/weft/sessions/p", headers=A)
            theirs = await http.post("/v1/completions", json=completion(1, "q", prompt=[4], session_stateful=True),
                                     headers=B)  # B's q still continues from its own context
            assert not [r for r in doors.executor.released if r.startswith("fork-b/")]  # B's pins untouched
            assert "fork-a/q" in doors.executor.released  # A's own q: absorbed, released with p
            return fork.status, joined.status, ended.status, theirs.status, await theirs.text()
        finally:
            await doors.close()

    fork, joined, ended, theirs, text = asyncio.run(main())
    assert (fork, joined, ended) == (200, 200, 200)
    assert theirs == 200, text
