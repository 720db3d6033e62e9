"""A choice that fails on its own (a session hop's branch, ``session_branches.
isolate_branch_failures``) carries the error the call would have failed with: gRPC
``GenerateResponse.error`` and HTTP ``choices[i].weft.error``, with a 429's retry hint."""
from __future__ import annotations

import asyncio

import pytest

from services.router.choice_streams import ChatChoice
from services.router.errors import OverloadedError, SessionBusyError, UpstreamUnavailable
from services.router.grpc_response import choice_error, response_chunk
from services.router.openai_format import ChatFormatter
from services.router.schema import Delta, Sampling, Session, TokenRequest, Usage
from services.router.session_branches import Branches, isolate_branch_failures
from weft.v1 import common_pb2


def delta(text: str = "a", finish: str | None = None, error: Exception | None = None) -> Delta:
    return Delta(text, (7,) if text else (), (), finish, Usage(3, 1, 0), "e0", error=error)


async def failing(after: int, exc: Exception):
    for _ in range(after):
        yield delta()
    raise exc


def requests(session_id: str, n: int) -> list[TokenRequest]:
    return [TokenRequest(f"r{i}", "m", (1, 2), Sampling(), "t",
                         Session(session_id=f"{session_id}.h1.n{i}" if i and session_id else session_id, hop_index=1))
            for i in range(n)]


async def drain(stream) -> list[Delta]:
    return [d async for d in stream]


def test_a_branch_error_becomes_its_last_delta_and_the_session_hop_itself_still_raises():
    async def main():
        branches = Branches(requests("s", 3), forked=True)
        streams = isolate_branch_failures(
            [failing(1, UpstreamUnavailable("executor lost")), failing(2, OverloadedError("full", 1500)),
             failing(0, SessionBusyError("busy"))], branches)
        with pytest.raises(UpstreamUnavailable):
            await drain(streams[0])
        return await drain(streams[1]), await drain(streams[2])

    two_then_error, only_error = asyncio.run(main())
    assert [d.finish_reason for d in two_then_error] == [None, None, "error"]
    last = two_then_error[-1]
    assert isinstance(last.error, OverloadedError) and last.usage == Usage(3, 1, 0) and last.executor == "e0"
    assert only_error[0].finish_reason == "error" and only_error[0].usage == Usage(0, 0, 0)


def test_without_a_session_the_n_completions_fail_the_call_whole_as_vllm_and_openai_do():
    async def main():
        streams = isolate_branch_failures([failing(0, UpstreamUnavailable("x")), failing(0, UpstreamUnavailable("y"))],
                                          Branches(requests("", 2)))
        with pytest.raises(UpstreamUnavailable):
            await drain(streams[1])
    asyncio.run(main())


def test_a_cancelled_branch_is_not_reported_as_failed():
    async def main():
        streams = isolate_branch_failures([failing(0, UpstreamUnavailable("x")),
                                           failing(1, asyncio.CancelledError())], Branches(requests("s", 2), True))
        with pytest.raises(asyncio.CancelledError):
            await drain(streams[1])
    asyncio.run(main())


@pytest.mark.parametrize("exc, code, retry", [(OverloadedError("queue full", 1500), "RESOURCE_EXHAUSTED", 1500),
                                              (UpstreamUnavailable("executor lost"), "UNAVAILABLE", 0),
                                              (KeyError("bug"), "INTERNAL", 0)])
def test_grpc_names_the_status_the_call_would_have_ended_with(exc, code, retry):
    chunk = response_chunk("r", 1, delta("", "error", exc), Sampling(), None, "")
    assert chunk.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert (chunk.error.code, chunk.error.retry_after_ms) == (code, retry)
    assert chunk.error.message == (str(exc) if code != "INTERNAL" else "internal error (KeyError)")
    assert not response_chunk("r", 0, delta("", "stop"), Sampling(), None, "").HasField("error")
    assert choice_error(OverloadedError("x" * 10_000)).message.endswith("(10000 characters in all)")


def test_http_names_the_status_type_and_retry_hint_of_the_error():
    choice = ChatChoice(1, None, None, False, "s.h1.n1")
    choice.add(delta("hi"))
    choice.add(delta("", "error", OverloadedError("queue full", 2500)))
    body = choice.body(ChatFormatter("r", "m", False))
    assert body["finish_reason"] == "error" and body["message"]["content"] == "hi"
    assert body["weft"]["error"] == {"message": "queue full", "type": "rate_limit_error", "param": None,
                                     "code": None, "status": 429, "retry_after_ms": 2500}
    assert body["weft"]["session_id"] == "s.h1.n1"
