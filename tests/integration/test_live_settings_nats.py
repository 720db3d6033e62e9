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


def test_routers_share_the_whole_document_and_no_other_role_may_read_it(tmp_path):
    """weft.routersettings carries API keys between router replicas (the newest document
    wins): a second router receives it; a scheduler's subscription is refused."""
    async def scenario(server: NatsServer, passwords: dict[str, str]) -> None:
        got: list[bytes] = []
        peer = await nats.connect(server.url, user="router", password=passwords["router"])

        async def on_msg(msg) -> None:
            got.append(msg.data)

        await peer.subscribe("weft.routersettings.*", cb=on_msg)
        await peer.flush()
        violations: list[str] = []

        async def on_error(exc):
            violations.append(str(exc))

        snoop = await nats.connect(server.url, user="scheduler", password=passwords["scheduler"], error_cb=on_error)
        await snoop.subscribe("weft.routersettings.*", cb=on_msg)
        await snoop.flush()
        router = await nats.connect(server.url, user="router", password=passwords["router"])
        await router.publish("weft.routersettings.router-a", b'{"version": 3, "keys": "..."}')
        await router.flush()
        deadline = asyncio.get_running_loop().time() + 10
        while (not got or not violations) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)  # waiting on a condition: the delivery and the server's -ERR
        assert got == [b'{"version": 3, "keys": "..."}']  # the peer router only: the scheduler got nothing
        assert any("permissions violation" in v.lower() for v in violations)
        for conn in (peer, snoop, router):
            await conn.close()

    passwords = nats_auth.random_passwords()
    with NatsServer(log_path=tmp_path / "nats.log", passwords=passwords) as server:
        asyncio.run(scenario(server, passwords))
