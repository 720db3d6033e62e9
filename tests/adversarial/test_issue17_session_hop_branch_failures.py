"""Issue 17, a session hop's ``n > 1`` branch that fails on its own, through the real
scheduler client and an in-process scheduler with a fake executor (the fixtures of
test_issue17_session_hop_choices.py).

Found: one failed choice failed the whole call while choice 0 had finished the hop, so the
client read the hop as failed and asking it again was refused as the wrong hop. A branch now
fails on its own (``session_branches.isolate_branch_failures``)."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.adversarial.test_issue17_session_hop_choices import (A, JSON_OUT, grpc_hop, mesh_doors, model_dir,
                                                                sessions_of)
from tests.unit.router.test_session_lifecycle_doors import completion, grpc_key
from tests.waiting import until
from weft.v1 import common_pb2

__all__ = ["model_dir"]  # the module fixture, shared


async def sse_finishes(resp) -> dict[int, dict]:
    """Each choice's finishing chunk choice of an SSE stream, by index."""
    finishes = {}
    async for line in resp.content:
        if line.startswith(b"data: {"):
            finishes.update({c["index"]: c for c in json.loads(line[6:]).get("choices", []) if c["finish_reason"]})
    return finishes


@pytest.mark.parametrize("door", ["http", "http_stream", "grpc"])
def test_a_branch_that_fails_ends_its_own_choice_and_leaves_the_hop_and_the_other_branches_standing(
        model_dir, monkeypatch, door):
    """Found: one failed choice failed the whole call while choice 0 had finished the hop, so
    the client read the hop as failed and asking it again was refused as the wrong hop. Now
    the failed branch finishes "error" with the error it would have failed the call with, is
    ended, and the session continues from choice 0."""
    async def main():
        async with mesh_doors(model_dir, monkeypatch) as mesh:
            await mesh.post(completion(0, "s"))
            mesh.executor.refuse_suffix = ".n1"  # the executor refuses the first branch only
            if door == "grpc":
                chunks = [c async for c in mesh.grpc.Generate(grpc_hop(1), metadata=grpc_key("sk-a"))]
                finishes = {c.index: c for c in chunks if c.finish_reason}
            elif door == "http_stream":
                resp = await mesh.http.post("/v1/completions", json=completion(1, "s", n=3, stream=True, **JSON_OUT),
                                            headers=A)
                assert resp.status == 200
                finishes = await sse_finishes(resp)
            else:
                status, body = await mesh.post(completion(1, "s", n=3, **JSON_OUT))
                assert status == 200, body
                finishes = {c["index"]: c for c in body["choices"]}
            await until(lambda: not mesh.left_behind(["s.h1.n1"]), "the failed branch to end")
            mesh.executor.refuse_suffix = None
            kept = mesh.left_behind(["s.h1.n2"])
            return finishes, kept, await mesh.post(completion(2, "s", n=2))

    finishes, kept, next_hop = asyncio.run(main())
    assert sorted(finishes) == [0, 1, 2]
    if door == "grpc":
        assert [finishes[i].finish_reason for i in (0, 1, 2)] == [common_pb2.FINISH_REASON_LENGTH,
                                                                   common_pb2.FINISH_REASON_ERROR,
                                                                   common_pb2.FINISH_REASON_LENGTH]
        error = finishes[1].error
        assert error.code == "INVALID_ARGUMENT" and error.message.startswith("sampling.grammar: cannot be enforced")
        assert not finishes[0].HasField("error") and not finishes[2].HasField("error")
    else:
        assert [finishes[i]["finish_reason"] for i in (0, 1, 2)] == ["length", "error", "length"]
        error = finishes[1]["weft"]["error"]
        assert error["status"] == 400 and error["param"] == "response_format", error
        assert error["type"] == "invalid_request_error" and "cannot compile" in error["message"]
        assert finishes[0]["weft"]["error"] is None and finishes[2]["weft"]["error"] is None
        assert finishes[1]["weft"]["session_id"] == "s.h1.n1"
    assert kept == ["s.h1.n2"]  # the branch whose hop finished stays, to be continued on
    # the session moved on with choice 0: its next hop is 2 (before: the client saw the hop fail)
    assert next_hop[0] == 200 and sessions_of(next_hop[1]) == ["s", "s.h2.n1"], next_hop
