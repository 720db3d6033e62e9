"""Issue 16, unlucky operator: the router's first scheduler attempt now runs outside
tenacity (scheduler_client.py). With the scheduler unreachable, the retry semantics must
be what they were when tenacity ran every attempt: MAX_ATTEMPTS tries, then more only
while the scheduler is not there at all and the outage window (counted from before the
first attempt) lasts; never a retry of a non-retryable code.

Time is a fake clock: each attempt "takes" one second of it (a connect that hangs), so
the window's arithmetic is exact and the test never waits on real time.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
import tenacity

from services.mesh import retry
from services.router import scheduler_client
from services.router.errors import InvalidRequestError, UpstreamUnavailable
from services.router.scheduler_client import MAX_ATTEMPTS, SchedulerClient
from services.router.schema import Sampling, Session, TokenRequest

ATTEMPT_S = 1.0  # fake seconds one failed attempt takes


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def monotonic(self) -> float:
        return self.now_s


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="down")


class DeadStub:
    """A scheduler stub whose every call fails with ``code`` after ATTEMPT_S fake seconds."""

    def __init__(self, clock: FakeClock, code: grpc.StatusCode) -> None:
        self.clock, self.code, self.num_calls = clock, code, 0

    def Generate(self, message, timeout, metadata):  # noqa: N802 (gRPC's name)
        stub = self

        class Call:
            async def read(self):
                stub.num_calls += 1
                stub.clock.now_s += ATTEMPT_S
                raise _error(stub.code)

            def cancel(self):
                return True

        return Call()


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(scheduler_client, "_now", fake.monotonic, raising=False)
    # tenacity's own clock too: the old code measured the window with it
    monkeypatch.setattr(tenacity, "time", type("T", (), {"monotonic": staticmethod(fake.monotonic)}))
    fast = retry.rpc_retrying

    def no_waits(max_attempts=3, initial_s=0.05, max_wait_s=1.0):  # the waits' lengths are not under test
        return fast(max_attempts=max_attempts, initial_s=0.0001, max_wait_s=0.0001)

    monkeypatch.setattr(scheduler_client, "rpc_retrying", no_waits)
    return fake


def _request() -> TokenRequest:
    return TokenRequest(request_id="r1", model="m", prompt_token_ids=(1, 2), tenant="t",
                        sampling=Sampling(max_tokens=2), session=Session())


async def _generate(stub: DeadStub, timeout_s: float) -> None:
    client = SchedulerClient("127.0.0.1:1")  # never connected: the channel is not READY
    client._stub = stub
    try:
        async for _ in client.generate(_request(), timeout_s=timeout_s):
            pass
    finally:
        await client.close()


@pytest.mark.parametrize("timeout_s, window_s", [(20.0, 5.0), (6.0, 3.0), (2.0, 1.0)])
def test_an_unreachable_scheduler_is_retried_for_the_outage_window_from_the_first_attempt(clock, timeout_s, window_s):
    """Attempt k starts at (k - 1) fake seconds; a new one is made only while fewer than
    ``window_s`` seconds have passed since the first began (and at least MAX_ATTEMPTS)."""
    stub = DeadStub(clock, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(UpstreamUnavailable):
        asyncio.run(_generate(stub, timeout_s))
    assert stub.num_calls == max(MAX_ATTEMPTS, int(window_s / ATTEMPT_S))


def test_a_scheduler_that_refuses_the_argument_is_called_once(clock):
    stub = DeadStub(clock, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(InvalidRequestError):
        asyncio.run(_generate(stub, 20.0))
    assert stub.num_calls == 1
