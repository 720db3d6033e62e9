"""Peer authentication: the mesh secret interceptor, its client side, loopback defaults."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.mesh.mesh_auth import MeshSecurity, SharedSecretInterceptor, mesh_channel
from weft.v1 import scheduler_pb2, scheduler_pb2_grpc


class Echo(scheduler_pb2_grpc.SchedulerServicer):
    async def ListExecutors(self, request, context):
        return scheduler_pb2.ListExecutorsResponse()

    async def Generate(self, request, context):
        yield scheduler_pb2.ScheduleResponse(request_id=request.request_id)


async def _calls(client_secret: str) -> dict[str, grpc.StatusCode]:
    server = grpc.aio.server(interceptors=[SharedSecretInterceptor("s3cret")])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(Echo(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes = {}
    try:
        async with mesh_channel(f"127.0.0.1:{port}", security=MeshSecurity(secret=client_secret)) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            for name, call in (
                ("unary", lambda: stub.ListExecutors(scheduler_pb2.ListExecutorsRequest(), timeout=5)),
                ("stream", lambda: _drain(stub.Generate(scheduler_pb2.ScheduleRequest(request_id="r"), timeout=5))),
                ("health", lambda: health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)),
            ):
                try:
                    await call()
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    codes[name] = exc.code()
    finally:
        await server.stop(0)
    return codes


async def _drain(call):
    return [m async for m in call]


def test_calls_with_the_right_secret_pass():
    assert set(asyncio.run(_calls("s3cret")).values()) == {grpc.StatusCode.OK}


@pytest.mark.parametrize("secret", ["", "wrong", "s3cret-but-longer"])
def test_calls_without_the_right_secret_are_unauthenticated_but_health_stays_open(secret):
    codes = asyncio.run(_calls(secret))
    assert codes == {"unary": grpc.StatusCode.UNAUTHENTICATED, "stream": grpc.StatusCode.UNAUTHENTICATED,
                     "health": grpc.StatusCode.OK}


def test_security_settings_come_from_the_environment_and_are_validated():
    sec = MeshSecurity.from_environ({"WEFT_MESH_SECRET": "x", "WEFT_MESH_TLS_CA": "/ca.pem"})
    assert sec.secret == "x" and sec.client_tls and sec.server_credentials() is None
    with pytest.raises(ValueError):
        MeshSecurity(tls_cert_path="/c.pem")
    with pytest.raises(ValueError):
        SharedSecretInterceptor("")


def test_every_service_binds_loopback_by_default():
    from services.cachestore.config import CacheStoreConfig
    from services.executor.config import ExecutorConfig
    from services.router.config import RouterConfig
    from services.scheduler.config import SchedulerConfig

    for cls in (CacheStoreConfig, ExecutorConfig, RouterConfig, SchedulerConfig):
        host = next(f for f in dataclasses.fields(cls) if f.name == "host").default
        assert host == "127.0.0.1", f"{cls.__name__} binds {host!r} by default"


def _self_signed(tmp_path):
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_with_the_secret_serves_and_plaintext_clients_are_refused(tmp_path):
    from services.mesh.mesh_auth import add_port

    cert, key = _self_signed(tmp_path)
    sec = MeshSecurity(secret="s3cret", tls_cert_path=str(cert), tls_key_path=str(key), tls_ca_path=str(cert))

    async def main():
        server = grpc.aio.server(interceptors=[SharedSecretInterceptor(sec.secret)])
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(Echo(), server)
        port = add_port(server, "127.0.0.1:0", sec)
        await server.start()
        try:
            async with mesh_channel(f"127.0.0.1:{port}", security=sec) as channel:
                await scheduler_pb2_grpc.SchedulerStub(channel).ListExecutors(
                    scheduler_pb2.ListExecutorsRequest(), timeout=10)
            async with mesh_channel(f"127.0.0.1:{port}", security=MeshSecurity(secret="s3cret")) as plain:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await scheduler_pb2_grpc.SchedulerStub(plain).ListExecutors(
                        scheduler_pb2.ListExecutorsRequest(), timeout=3)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS handshake, no service
        finally:
            await server.stop(0)
    asyncio.run(main())
