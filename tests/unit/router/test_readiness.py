"""Readiness (``GET /health/ready``) apart from liveness (``GET /health``): the contract
``weft up`` and Compose healthchecks poll, against a fake scheduler executor list."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.readiness import Readiness
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_http import MODEL, FakeDownstream, run
from weft.testing.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


class FakeScheduler:
    """``list_executors`` with a scripted answer; counts calls."""

    def __init__(self) -> None:
        self.executors: list[dict] = []
        self.error: BaseException | None = None
        self.hang = False
        self.num_calls = 0
        self.release = asyncio.Event()

    async def list_executors(self) -> list[dict]:
        self.num_calls += 1
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        await self.release.wait()
        return list(self.executors)


async def _client(model_dir, scheduler: FakeScheduler, keys: dict | None = None):
    tokenizer = Tokenizer.from_dir(model_dir)
    limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)
    api = HttpApi(Generator(tokenizer, limits, FakeDownstream(tokenizer)), KeyStore(keys or {}), MODEL,
                  scheduler.list_executors)
    api.readiness = Readiness(scheduler.list_executors, timeout_s=0.2, ttl_s=0.0)  # no caching here
    client = TestClient(TestServer(api.app(1 << 20)))
    await client.start_server()
    return client, api


def _unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "refused")


def test_ready_only_with_a_serving_executor_while_health_stays_live(model_dir):
    async def go():
        sched = FakeScheduler()
        sched.release.set()
        client, api = await _client(model_dir, sched, keys={"sk-a": "acme"})  # open paths: no key needed
        try:
            resp = await client.get("/health/ready")
            assert resp.status == 503
            body = await resp.json()
            assert body["status"] == "not_ready" and "no serving executor" in body["reason"]
            assert (await client.get("/health")).status == 200  # liveness is not readiness

            sched.executors = [{"name": "e0", "state": "joining"}, {"name": "e1", "state": "failed"}]
            assert (await client.get("/health/ready")).status == 503

            sched.executors.append({"name": "e2", "state": "serving"})
            resp = await client.get("/health/ready")
            assert resp.status == 200
            assert await resp.json() == {"status": "ready", "num_serving_executors": 1}

            sched.error = _unavailable()
            resp = await client.get("/health/ready")
            assert resp.status == 503 and "unreachable" in (await resp.json())["reason"]

            sched.error, sched.hang = None, True  # a scheduler that never answers: bounded
            resp = await client.get("/health/ready")
            assert resp.status == 503 and "did not answer" in (await resp.json())["reason"]

            sched.hang = False
            api.draining = True
            resp = await client.get("/health/ready")
            assert resp.status == 503 and (await resp.json())["reason"] == "router is draining"
        finally:
            await client.close()
    run(go())


def test_concurrent_pollers_share_one_probe_and_answers_are_cached():
    async def go():
        sched = FakeScheduler()
        sched.executors = [{"name": "e0", "state": "serving"}]
        now = [100.0]
        readiness = Readiness(sched.list_executors, timeout_s=5.0, ttl_s=1.0, clock=lambda: now[0])
        pollers = [asyncio.ensure_future(readiness.check()) for _ in range(50)]
        await asyncio.sleep(0)  # all fifty are waiting on the probe
        sched.release.set()
        reports = await asyncio.gather(*pollers)
        assert all(r.ready and r.num_serving_executors == 1 for r in reports)
        assert sched.num_calls == 1
        assert (await readiness.check()).ready and sched.num_calls == 1  # cached within ttl
        now[0] += 1.5
        sched.executors = []
        assert not (await readiness.check()).ready and sched.num_calls == 2  # re-probed after ttl
    asyncio.run(go())


def test_a_poller_that_hangs_up_does_not_cancel_the_shared_probe():
    async def go():
        sched = FakeScheduler()
        sched.executors = [{"name": "e0", "state": "serving"}]
        readiness = Readiness(sched.list_executors, timeout_s=5.0, ttl_s=10.0)
        first = asyncio.ensure_future(readiness.check())
        second = asyncio.ensure_future(readiness.check())
        await asyncio.sleep(0)
        first.cancel()
        sched.release.set()
        assert (await second).ready
        assert sched.num_calls == 1
    asyncio.run(go())


def test_scheduler_client_reports_each_executors_state():
    from services.router.scheduler_client import SchedulerClient
    from weft.v1 import events_pb2, scheduler_pb2

    class Stub:
        async def ListExecutors(self, request, timeout):
            beat = lambda name, state: scheduler_pb2.ExecutorInfo(  # noqa: E731
                heartbeat=events_pb2.ExecutorHeartbeat(name=name, state=state))
            return scheduler_pb2.ListExecutorsResponse(executors=[
                beat("e0", events_pb2.EXECUTOR_STATE_SERVING), beat("e1", events_pb2.EXECUTOR_STATE_FAILED),
                beat("e2", 42)])

    async def go():
        client = SchedulerClient("127.0.0.1:1")
        client._stub = Stub()
        try:
            states = {e["name"]: e["state"] for e in await client.list_executors()}
            assert states == {"e0": "serving", "e1": "failed", "e2": "unspecified"}
        finally:
            await client.close()
    asyncio.run(go())
