"""The launcher's control endpoint serves whatever ``ControlTarget`` it is handed: a fake
target here, no launcher and no mesh. It refuses a wrong token, answers a bad request
with 400 and the target's reason, and its clients (`weft scale`, `weft chaos`) turn an
error reply into RuntimeError with that reason."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from weft.launcher.control import request_chaos, request_scale, start_control_server
from weft.launcher.mesh_state import MeshState


class _Target:
    def __init__(self) -> None:
        self.control_token = "t0ken"
        self.calls: list[tuple] = []

    def state(self) -> MeshState:
        return MeshState(launcher_pid=1, control_port=0, control_token=self.control_token, model_dir="m",
                         http_url="", grpc_address="", nats_url="")

    async def scale(self, service: str, replicas: int) -> list[str]:
        self.calls.append(("scale", service, replicas))
        if service != "executor":
            raise ValueError(f"only 'executor' scales, not {service!r}")
        return [f"executor-{i}" for i in range(replicas)]

    async def chaos(self, action: str, name: str) -> dict:
        self.calls.append(("chaos", action, name))
        return {"name": name, "action": action, "pid": 7, "alive": False}


def _serve(client):
    """Run ``client(state)`` against an endpoint serving a fake target; returns (result, target)."""
    async def main():
        target = _Target()
        runner, port = await start_control_server(target, "127.0.0.1")
        try:
            state = replace(target.state(), control_port=port)
            return await client(state), target
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_scale_and_chaos_reach_the_target():
    async def client(state):
        return (await request_scale(state, "executor", 2), await request_chaos(state, "kill", "executor-1"))

    (names, chaos), target = _serve(client)
    assert names == ["executor-0", "executor-1"]
    assert chaos == {"name": "executor-1", "action": "kill", "pid": 7, "alive": False}
    assert target.calls == [("scale", "executor", 2), ("chaos", "kill", "executor-1")]


def test_a_wrong_token_is_refused_before_the_target_is_asked():
    async def client(state):
        with pytest.raises(RuntimeError, match="bad control token"):
            await request_scale(replace(state, control_token="guess"), "executor", 1)

    _, target = _serve(client)
    assert target.calls == []


def test_a_bad_request_reports_the_targets_reason():
    async def client(state):
        with pytest.raises(RuntimeError, match="only 'executor' scales"):
            await request_scale(state, "router", 2)

    _serve(client)
