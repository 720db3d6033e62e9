"""Two meshes on ONE nats-server (services/mesh/settings_signing.py): routers whose mesh
secrets differ hear each other's documents and adopt none of them (a tenant of one mesh
never gets a key of the other, and neither mesh's keys are replaced); a scheduler's
follower applies only its own mesh's settings. Routers sharing a secret, or running
without one (development), converge as before: a key added on one works on the other.

Real routers (RouterLiveSettings.start: EventBus, republish loop) on a real server on a
free loopback port; every wait is on a condition with a deadline."""
from __future__ import annotations

import asyncio
import functools
import json

import pytest

from services.mesh.live_settings import SettingsFollower
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.nats_bus import EventBus
from services.mesh.nats_server import NatsServer
from services.router.auth import KeyStore
from services.router.live_settings import LiveOptions, RouterLiveSettings
from tests import waiting
from tests.live_settings_keys import knows

DEADLINE_S = 15.0
REPUBLISH_S = 0.1
KEYS_A = {"sk-mesh-a-admin1": {"tenant": "ops-a", "role": "admin"}, "sk-mesh-a-tenant": "tenant-of-a"}
KEYS_B = {"sk-mesh-b-admin1": {"tenant": "ops-b", "role": "admin"}, "sk-mesh-b-tenant": "tenant-of-b"}


def router(tmp_path, name: str, keys: dict, secret: str, url: str) -> RouterLiveSettings:
    folder = tmp_path / name
    folder.mkdir()
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps(keys))
    return RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file),
                              LiveOptions(nats_url=url, republish_s=REPUBLISH_S), writer=name,
                              security=MeshSecurity(secret=secret))


until = functools.partial(waiting.until, deadline_s=DEADLINE_S)  # this file's own bound


def test_two_meshes_on_one_nats_server_do_not_adopt_each_others_keys_or_settings(tmp_path):
    async def scenario(url: str) -> None:
        mesh_a = router(tmp_path, "router-mesh-a", KEYS_A, "secret-of-mesh-a", url)
        mesh_b = router(tmp_path, "router-mesh-b", KEYS_B, "secret-of-mesh-b", url)
        applied_b: list[dict] = []
        scheduler_b = SettingsFollower("scheduler", "scheduler", applied_b.append,
                                       security=MeshSecurity(secret="secret-of-mesh-b"))
        bus = EventBus(url, "scheduler")
        try:
            await bus.start()
            await scheduler_b.subscribe(bus)
            for live in (mesh_a, mesh_b):
                await live.start()
            await mesh_b.patch_when_caught_up({"scheduler": {"policy": "priority"}})
            await mesh_a.patch_when_caught_up({"keys": {"sk-mesh-a-new-01": "tenant-of-a"},
                                               "scheduler": {"policy": "fcfs"}})  # the newest document
            # A's documents from before the patch may be in flight: two more refusals by each
            # receiver of mesh B mean it heard at least one sent after the patch.
            b_refused, scheduler_refused = mesh_b.seal.num_refused, scheduler_b.seal.num_refused
            await until(lambda: mesh_b.seal.num_refused >= b_refused + 2
                        and scheduler_b.seal.num_refused >= scheduler_refused + 2, "mesh B to hear mesh A")
            await until(lambda: scheduler_b.version == mesh_b.document.version, "scheduler B to follow router B")
            # Mesh A hears B's documents on the same subject as its own (republished every
            # REPUBLISH_S); one may be superseded in A's inbox before its seal sees it, so the
            # refusal is waited for, not assumed by the time B has heard A.
            await until(lambda: mesh_a.seal.num_refused > 0, "mesh A to refuse a document of mesh B")
            assert mesh_b.document.writer == "router-mesh-b"
            assert dict(mesh_b.document.sections["scheduler"]) == {"policy": "priority"}
            assert knows(mesh_b, "sk-mesh-b-tenant")
            assert not any(knows(mesh_b, key) for key in (*KEYS_A, "sk-mesh-a-new-01"))
            assert not any(knows(mesh_a, key) for key in KEYS_B) and mesh_a.seal.num_refused > 0
            assert applied_b == [{"policy": "priority"}]
        finally:
            for live in (mesh_a, mesh_b):
                await live.stop()
            await bus.close()

    with NatsServer(log_path=tmp_path / "nats.log") as server:
        asyncio.run(scenario(server.url))


@pytest.mark.parametrize("secret", ["one-mesh-secret", ""], ids=["one secret", "no secret"])
def test_routers_of_one_mesh_converge_keys_included(tmp_path, secret):
    async def scenario(url: str) -> None:
        first = router(tmp_path, "router-1", KEYS_A, secret, url)
        second = router(tmp_path, "router-2", KEYS_A, secret, url)
        try:
            for live in (first, second):
                await live.start()
            await first.patch_when_caught_up({"keys": {"sk-added-on-one1": "globex"},
                                              "scheduler": {"policy": "fcfs"}})
            # the second router may still listen as the change is made: it adopts it, or claims its
            # files just before hearing it and the first router stamps its change again
            await until(lambda: second.document == first.document, "the routers to converge")
            assert dict(second.document.sections["scheduler"]) == {"policy": "fcfs"}
            assert knows(second, "sk-added-on-one1")
            assert first.seal.num_refused == second.seal.num_refused == 0
        finally:
            for live in (first, second):
                await live.stop()

    with NatsServer(log_path=tmp_path / "nats.log") as server:
        asyncio.run(scenario(server.url))
