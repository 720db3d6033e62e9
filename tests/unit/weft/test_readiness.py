"""`weft up` waits on the router's readiness (GET /health/ready: 503 until an executor
serves, then 200) before it reports the mesh up; a router without the route (404) is not
waited on further (the scheduler already lists every executor). A fake router on a free
loopback port stands in for the real one: no mesh, no processes."""
from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from weft.launcher.launcher import Launcher, MeshStartError, UpOptions


async def _fake_router(statuses: list[int]) -> tuple[web.AppRunner, int, list[int]]:
    """Answers /health/ready with ``statuses`` in turn (the last one repeats)."""
    served: list[int] = []

    async def ready(_request):
        status = statuses[min(len(served), len(statuses) - 1)]
        served.append(status)
        return web.json_response({"status": "ready" if status == 200 else "not_ready"}, status=status)

    app = web.Application()
    app.router.add_get("/health/ready", ready)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1], served


async def _wait(statuses: list[int], timeout_s: float = 20.0) -> list[int]:
    runner, port, served = await _fake_router(statuses)
    try:
        launcher = Launcher(UpOptions(http_port=0, grpc_port=0, startup_timeout_s=timeout_s))
        launcher.ports["router_http_port"] = port
        await launcher._wait_router_ready(time.monotonic() + timeout_s)
        return served
    finally:
        await runner.cleanup()


def test_up_waits_while_the_router_is_not_ready_and_returns_once_it_is():
    served = asyncio.run(_wait([503, 503, 503, 200]))
    assert served == [503, 503, 503, 200]


def test_a_router_without_the_readiness_route_is_not_waited_on():
    assert asyncio.run(_wait([404])) == [404]


def test_a_router_never_ready_fails_the_start_naming_the_url():
    with pytest.raises(MeshStartError, match="/health/ready"):
        asyncio.run(_wait([503], timeout_s=0.5))
