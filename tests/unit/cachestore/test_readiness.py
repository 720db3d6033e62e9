"""The cachestore reports NOT_SERVING until its embedding model is loaded, then SERVING,
and logs how long the load took. A fake loader that blocks until released stands in for
the model (no timing: the test releases it)."""
from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from services.cachestore.app import serve_when_ready
from services.cachestore.semantic_service import SemanticService
from services.mesh.grpc_server import GrpcServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GatedLoader:
    """An embedder whose ``load`` blocks until ``release`` is set (or raises ``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.error = error
        self.loaded = False

    def load(self) -> None:
        self.started.set()
        if not self.release.wait(timeout=30):
            raise TimeoutError("the test never released the loader")
        if self.error is not None:
            raise self.error
        self.loaded = True


async def _status(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        return reply.status


async def _run(loader: GatedLoader) -> tuple[list[int], BaseException | None]:
    server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, grace_s=0.1)
    port = await server.start()
    statuses = []
    try:
        warm = asyncio.create_task(serve_when_ready(server, SemanticService(embedder=loader)))
        await asyncio.to_thread(loader.started.wait, 10)
        statuses.append(await _status(port))  # while the model loads
        loader.release.set()
        try:
            await warm
        except Exception as e:  # noqa: BLE001 - returned to the test
            return statuses + [await _status(port)], e
        statuses.append(await _status(port))
        return statuses, None
    finally:
        loader.release.set()
        await server.server.stop(0)


def test_not_serving_while_the_model_loads_and_serving_once_loaded():
    loader = GatedLoader()
    with capture_logs() as logs:
        statuses, error = asyncio.run(_run(loader))
    assert error is None and loader.loaded
    assert statuses == [NOT_SERVING, SERVING]
    loaded = [e for e in logs if e["event"] == "embedding_model_loaded"]
    assert len(loaded) == 1 and loaded[0]["load_ms"] >= 0 and loaded[0]["model"] == "all-MiniLM-L6-v2"


def test_a_model_that_fails_to_load_never_reports_serving():
    statuses, error = asyncio.run(_run(GatedLoader(error=OSError("checkpoint missing"))))
    assert isinstance(error, OSError)
    assert statuses == [NOT_SERVING, NOT_SERVING]


def test_service_readiness_follows_the_embedder():
    loader = GatedLoader()
    service = SemanticService(embedder=loader)
    assert not service.ready
    loader.release.set()
    asyncio.run(service.warm_up())
    assert service.ready


def test_a_server_draining_before_the_load_ends_stays_not_serving():
    async def run() -> int:
        server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, grace_s=0.1)
        port = await server.start()
        loader = GatedLoader()
        try:
            warm = asyncio.create_task(serve_when_ready(server, SemanticService(embedder=loader)))
            await asyncio.to_thread(loader.started.wait, 10)
            server.draining = True  # what drain() sets first
            loader.release.set()
            await warm
            return await _status(port)
        finally:
            loader.release.set()
            await server.server.stop(0)

    assert asyncio.run(run()) == NOT_SERVING
