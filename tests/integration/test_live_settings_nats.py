"""The live-settings subject on a real nats-server with the mesh's users file: only the
router may publish ``weft.settings.>``; a scheduler and an executor receive what it sends
(services/mesh/nats_auth.py, docs/live_config.md)."""
from __future__ import annotations

import asyncio

import nats

from services.mesh import nats_auth
from services.mesh.nats_server import NatsServer


def test_only_the_router_may_publish_settings_and_scheduler_and_executor_receive_them(tmp_path):
    async def scenario(server: NatsServer, passwords: dict[str, str]) -> None:
        got: dict[str, list[bytes]] = {"scheduler": [], "executor": []}
        readers = []
        for role in got:
            reader = await nats.connect(server.url, user=role, password=passwords[role])

            async def on_msg(msg, role=role) -> None:
                got[role].append(msg.data)

            await reader.subscribe("weft.settings.*", cb=on_msg)
            await reader.flush()
            readers.append(reader)
        for role in ("executor", "scheduler", "cachestore"):
            violations: list[str] = []

            async def on_error(exc, violations=violations):
                violations.append(str(exc))

            forger = await nats.connect(server.url, user=role, password=passwords[role], error_cb=on_error)
            await forger.publish("weft.settings.router", b'{"version": 99}')
            await forger.flush()
            deadline = asyncio.get_running_loop().time() + 10
            while not violations and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)  # waiting on a condition: the server's -ERR
            assert any("permissions violation" in v.lower() for v in violations), role
            await forger.close()
        router = await nats.connect(server.url, user="router", password=passwords["router"])
        await router.publish("weft.settings.router", b'{"version": 2}')
        await router.flush()
        deadline = asyncio.get_running_loop().time() + 10
        while not all(got.values()) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert got == {"scheduler": [b'{"version": 2}'], "executor": [b'{"version": 2}']}
        await router.close()
        for reader in readers:
            await reader.close()

    passwords = nats_auth.random_passwords()
    with NatsServer(log_path=tmp_path / "nats.log", passwords=passwords) as server:
        asyncio.run(scenario(server, passwords))
