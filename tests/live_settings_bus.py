"""Routers and followers of the live settings on a real nats-server with the mesh's role
logins (tests/integration/test_live_settings_ask.py, tests/adversarial/test_settings_ask_attacks.py).

The server runs on a free loopback port and stops in ``finally`` (the ``nats_mesh``
fixture's context manager). Routers republish every 600 s, so within a test only a
change's own publish or an answer to an ask can deliver a document."""
from __future__ import annotations

import functools
import json
import time

import pytest

from services.mesh import nats_auth
from services.mesh.live_settings import SettingsFollower
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.nats_bus import EventBus
from services.mesh.nats_server import NatsServer
from services.router.auth import KeyStore
from services.router.live_settings import LiveOptions, RouterLiveSettings
from tests import waiting

SECRET = "live-settings-bus-secret"
REPUBLISH_S = 600.0  # never within a test
until = functools.partial(waiting.until, deadline_s=30.0)


@pytest.fixture
def nats_mesh(tmp_path, monkeypatch):
    """(server, passwords): a NATS server requiring the roles' logins; a router in this
    process logs in as ``router`` (its bus reads the variables)."""
    passwords = nats_auth.random_passwords()
    monkeypatch.setenv(nats_auth.USER_ENV, "router")
    monkeypatch.setenv(nats_auth.PASSWORD_ENV, passwords["router"])
    with NatsServer(log_path=tmp_path / "nats.log", passwords=passwords) as server:
        yield server, passwords


def make_router(tmp_path, url: str, writer: str = "r1", secret: str = SECRET,
                clock=time.time, republish_s: float = REPUBLISH_S) -> RouterLiveSettings:
    """A router whose settings file sets the scheduler's policy to fcfs, with one admin key."""
    folder = tmp_path / writer
    folder.mkdir(exist_ok=True)
    settings_file = folder / "settings.json"
    settings_file.write_text(json.dumps({"scheduler": {"policy": "fcfs"}}))
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps({"sk-ops-admin-0001": {"tenant": "ops", "role": "admin"}}))
    return RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file),
                              LiveOptions(settings_file=str(settings_file), nats_url=url, republish_s=republish_s),
                              writer=writer, clock=clock, security=MeshSecurity(secret=secret))


async def started_router(tmp_path, url: str, writer: str = "r1", **kw) -> RouterLiveSettings:
    """A router that has claimed its document and published it once (to nobody); its own
    listen window (1.5 republish periods) is cut short by claiming for it."""
    live = make_router(tmp_path, url, writer, **kw)
    await live.start()
    await until(lambda: live.bus.connected, f"router {writer} to connect")
    live.claim()
    await live.publish()
    return live


def follower(role: str, passwords: dict[str, str], url: str, secret: str = SECRET,
             name: str = "") -> tuple[SettingsFollower, EventBus, list[dict]]:
    """A ``role`` service's follower (applied sections recorded) and its own bus, not started."""
    applied: list[dict] = []
    follow = SettingsFollower(role, role, applied.append, security=MeshSecurity(secret=secret))
    bus = EventBus(url, name or f"{role}-1", auth=nats_auth.ClientAuth(role, passwords[role]))
    return follow, bus, applied
