"""Health probes of mesh services, shared by ``weft up`` / ``weft ps`` and the compose
healthchecks (``python -m weft.health grpc 127.0.0.1:50052``).

    grpc  standard grpc.health.v1 Check: SERVING is healthy
    http  GET returns 2xx
    tcp   the port accepts a connection
"""
from __future__ import annotations

import asyncio
import sys
import urllib.error
import urllib.request

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.mesh.mesh_auth import mesh_channel


async def probe_grpc(address: str, timeout_s: float = 1.0) -> bool:
    try:
        async with mesh_channel(address) as channel:  # TLS when the mesh is configured with it
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except (grpc.aio.AioRpcError, OSError):
        return False


def _get(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


async def probe_http(url: str, timeout_s: float = 1.0) -> bool:
    # aiohttp, not a thread: the launcher forks children and keeps no helper threads.
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url) as resp:
                return 200 <= resp.status < 300
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def probe_tcp(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def probe(kind: str, host: str, port: int, path: str = "", timeout_s: float = 1.0) -> bool:
    if kind == "grpc":
        return await probe_grpc(f"{host}:{port}", timeout_s)
    if kind == "http":
        return await probe_http(f"http://{host}:{port}{path}", timeout_s)
    if kind == "tcp":
        return await probe_tcp(host, port, timeout_s)
    raise ValueError(f"unknown probe kind {kind!r}")


def main(argv: list[str]) -> int:
    """``python -m weft.health grpc HOST:PORT`` | ``http URL``: exit 0 when healthy."""
    if len(argv) != 2 or argv[0] not in ("grpc", "http"):
        print("usage: python -m weft.health grpc HOST:PORT | http URL", file=sys.stderr)
        return 2
    kind, target = argv
    ok = asyncio.run(probe_grpc(target, 2.0)) if kind == "grpc" else _get(target, 2.0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
