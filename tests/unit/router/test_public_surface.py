"""The router's public surface as built by RouterApp: /metrics only on its own listener
(loopback by default), and one request cap for HTTP bodies and gRPC messages. In-process,
no scheduler behind it (nothing here generates)."""
from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import grpc
import pytest

from services.mesh.nats_server import free_port
from services.router.app import RouterApp
from services.router.config import RouterConfig
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import router_pb2, router_pb2_grpc

KEY = "sk-surface"
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


@pytest.fixture()
def keys_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"{KEY} acme\n")
    return str(path)


def _config(model_dir, keys_file, **overrides) -> RouterConfig:
    return RouterConfig(model_dir=str(model_dir), grpc_port=0, http_port=0, keys_file=keys_file,
                        scheduler_address="127.0.0.1:1", **overrides)


async def _started(config: RouterConfig) -> RouterApp:
    app = RouterApp(config)
    await app.start()
    return app


async def _stop(app: RouterApp) -> None:
    await app.grpc.server.stop(0)
    await app.stop()


def test_metrics_listener_binds_loopback_by_default():
    defaults = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
    assert defaults["metrics_host"] == "127.0.0.1"


def test_public_port_refuses_metrics_while_the_metrics_port_serves_them(model_dir, keys_file):
    async def go():
        metrics_port = free_port()
        app = await _started(_config(model_dir, keys_file, metrics_port=metrics_port))
        try:
            public = f"http://127.0.0.1:{app.http_port}"
            async with aiohttp.ClientSession() as http:
                for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
                    async with http.get(f"{public}/metrics", headers=headers) as resp:
                        assert resp.status == 404
                async with http.get(f"{public}/health") as resp:
                    assert resp.status == 200  # probes need no key
                async with http.get(f"{public}/v1/models") as resp:
                    assert resp.status == 401
                async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                    assert resp.status == 200
                    assert "weft_router_requests_total" in await resp.text()
        finally:
            await _stop(app)
    asyncio.run(go())


def test_grpc_message_over_the_body_cap_is_resource_exhausted_and_the_router_keeps_serving(
        model_dir, keys_file):
    async def go():
        app = await _started(_config(model_dir, keys_file, max_body_bytes=4096))
        assert app.grpc.port
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc.port}")
        stub = router_pb2_grpc.RouterStub(channel)
        meta = (("authorization", f"Bearer {KEY}"),)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                call = stub.Generate(router_pb2.GenerateRequest(text="x" * 8192), metadata=meta, timeout=10)
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in err.value.details()
            models = await stub.ListModels(router_pb2.ListModelsRequest(), metadata=meta, timeout=10)
            assert models.models[0].id == MODEL
        finally:
            await channel.close()
            await _stop(app)
    asyncio.run(go())


def test_http_body_over_the_same_cap_is_413(model_dir, keys_file):
    async def go():
        app = await _started(_config(model_dir, keys_file, max_body_bytes=4096))
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://127.0.0.1:{app.http_port}/v1/completions", data=b"x" * 8192,
                                     headers={"Authorization": f"Bearer {KEY}"}) as resp:
                    assert resp.status == 413
        finally:
            await _stop(app)
    asyncio.run(go())
