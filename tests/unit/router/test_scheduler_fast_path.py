"""The router → scheduler call's first attempt stays off tenacity (issue 16: its retry
loop cost ~0.14 ms per request on the first-token path); a failure still retries."""
from __future__ import annotations

import asyncio

import grpc
import pytest

import services.router.scheduler_client as scheduler_client
from services.router.errors import UpstreamUnavailable
from tests.unit.router.test_scheduler_retry import FlakyScheduler, _collect


def test_a_call_that_succeeds_at_once_never_builds_a_retry_policy(monkeypatch):
    def no_policy(**kwargs):
        raise AssertionError("the retry policy was built for a call that needed none")

    monkeypatch.setattr(scheduler_client, "rpc_retrying", no_policy)
    servicer = FlakyScheduler([])
    chunks = asyncio.run(_collect(servicer))
    assert [c.token_ids for c in chunks] == [(1,), (2,)] and servicer.num_calls == 1


def test_a_first_attempt_that_fails_retryably_is_counted_by_the_policy_as_its_first():
    servicer = FlakyScheduler([grpc.StatusCode.UNAVAILABLE] * scheduler_client.MAX_ATTEMPTS)
    with pytest.raises(UpstreamUnavailable):  # the bound was reached: the last UNAVAILABLE reaches the caller
        asyncio.run(_collect(servicer))
    assert servicer.num_calls == scheduler_client.MAX_ATTEMPTS
