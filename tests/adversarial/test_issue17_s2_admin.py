"""Issue 17 (session 2), the live settings attacked by a hostile admin client and an unlucky
operator: a change must never open a router that runs with keys (a ``{"keys": null}``
patch, a SIGHUP while the keys file is empty or half written), never lock the admin API
out of itself (a patch removing the last admin key), and a body the decoder cannot nest
into is a 400, not a 500. The version guard takes an integer only (``true`` equals 1)."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from services.mesh.live_settings import SettingsError
from services.router.admin_routes import AdminRoutes
from services.router.auth import KeyStore
from services.router.errors import AuthenticationError
from services.router.live_settings import LiveOptions, RouterLiveSettings, VersionConflict

PATH = "/v1/weft/admin/settings"
ADMIN = {"Authorization": "Bearer sk-admin"}
KEYS = {"sk-admin": {"tenant": "ops", "role": "admin"}, "sk-acme": "acme"}


@pytest.fixture(autouse=True)
def _logs():
    with capture_logs() as logs:  # another test may have bound structlog to a closed stream
        yield logs


def router(tmp_path) -> RouterLiveSettings:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    settings_file = tmp_path / "settings.json"
    settings_file.write_text("{}")
    return RouterLiveSettings(KeyStore.from_file(keys_file), str(keys_file), LiveOptions(settings_file=str(settings_file)))


def assert_still_closed(live: RouterLiveSettings) -> None:
    """The router still asks for a key and the old keys still work."""
    with pytest.raises(AuthenticationError):
        live.keys.authenticate(None)
    assert live.keys.authenticate("sk-acme") == "acme" and live.keys.is_admin("sk-admin")


@pytest.mark.parametrize("patch", [{"keys": None}, {"keys": {"sk-admin": None, "sk-acme": None}}])
def test_a_patch_removing_every_key_is_refused_instead_of_opening_the_router(tmp_path, patch):
    live = router(tmp_path)
    with pytest.raises(SettingsError) as err:
        live.patch(patch)
    assert err.value.field == "keys" and "open" in str(err.value)
    assert_still_closed(live)
    assert json.loads((tmp_path / "keys.json").read_text()) == KEYS  # nothing written back
    assert live.document.version == 1


def test_a_patch_removing_the_last_admin_key_is_refused_but_another_admin_may_remove_this_one(tmp_path):
    live = router(tmp_path)
    with pytest.raises(SettingsError) as err:
        live.patch({"keys": {"sk-admin": None}})
    assert err.value.field == "keys" and "last admin key" in str(err.value)
    assert live.keys.is_admin("sk-admin")
    live.patch({"keys": {"sk-ops2": {"tenant": "ops", "role": "admin"}}})
    live.patch({"keys": {"sk-admin": None}})  # another admin remains: the API is still reachable
    assert live.keys.is_admin("sk-ops2")
    with pytest.raises(AuthenticationError):
        live.keys.authenticate("sk-admin")


@pytest.mark.parametrize("content", ["", "# being rewritten\n", "{}"])
def test_sighup_while_the_keys_file_is_empty_keeps_the_old_keys_with_a_readable_error(tmp_path, _logs, content):
    live = router(tmp_path)
    (tmp_path / "keys.json").write_text(content)
    live._on_sighup()
    assert_still_closed(live)
    refused = [e for e in _logs if e["event"] == "live_settings_reload_refused"]
    assert len(refused) == 1 and "every API key" in refused[0]["error"] and refused[0]["running_version"] == 1


@pytest.mark.parametrize("content", ['{"sk-admin": ', "sk-acme\n", "\udcff"])
def test_sighup_with_a_broken_keys_file_keeps_the_old_keys(tmp_path, _logs, content):
    live = router(tmp_path)
    (tmp_path / "keys.json").write_text(content, encoding="utf-8", errors="surrogateescape")
    live._on_sighup()
    assert_still_closed(live)
    assert [e["event"] for e in _logs].count("live_settings_reload_refused") == 1


def test_an_operator_may_still_remove_every_admin_from_the_keys_file(tmp_path):
    """Only the API is guarded against locking itself out: the file is the operator's."""
    live = router(tmp_path)
    (tmp_path / "keys.json").write_text("sk-acme acme\n")
    live._on_sighup()
    assert not live.keys.is_admin("sk-acme") and live.keys.authenticate("sk-acme") == "acme"


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_the_version_guard_takes_an_integer_only(tmp_path, version):
    live = router(tmp_path)
    with pytest.raises(VersionConflict):
        live.patch({"version": version, "scheduler": {"policy": "fcfs"}})
    assert live.document.version == 1 and not live.document.sections


@pytest.mark.parametrize("body", [
    "[" * 100_000 + "]" * 100_000,  # the decoder's recursion
    '{"scheduler": {"policy": ' + '{"a": ' * 900 + "1" + "}" * 902,  # parses; merge_patch recurses
])
def test_a_deeply_nested_patch_is_a_400_and_changes_nothing(tmp_path, body):
    live = router(tmp_path)

    async def scenario():
        app = web.Application()
        AdminRoutes(live).register(app)
        async with TestClient(TestServer(app)) as client:
            r = await client.patch(PATH, data=body, headers={**ADMIN, "Content-Type": "application/json"})
            return r.status, await r.json()

    status, answer = asyncio.run(scenario())
    assert status == 400, answer
    assert answer["error"]["param"] in ("(body)", "scheduler.policy")
    assert live.document.version == 1


SCHEDULER_VALUES = [
    {"max_pinned_fraction": 0}, {"max_pinned_fraction": 1}, {"degradation_thresholds": "none=1:1"},
    {"degradation_thresholds": "shed=0:0"}, {"tenant_quotas": "acme=" + "9" * 5000}, {"tenant_quotas": "acme=0"},
    {"tenant_quotas": "acme=1,acme=2"}, {"degradation_rungs": ",,,"}, {"degradation_min_dwell_s": 1e308},
    {"block_second_ms": 0, "transfer_ms_per_block": 0, "prefill_ms_per_token": 0, "default_tool_ms": 0},
    {"executor_overcommit": 1e308},
]
EXECUTOR_PARTITIONS = ["a=1:1,a=2:2", "a=" + "9" * 5000 + ":1", "a=0:0", " a = 4:2 , b=1:0"]


def _scheduler_applies(overrides: dict) -> bool:
    """What SchedulerLiveSettings.apply builds before it swaps anything in."""
    import dataclasses

    from services.scheduler.config import SchedulerConfig
    from services.scheduler.policy.contracts import parse_tenant_quotas
    from services.scheduler.policy.degradation import DegradationLadder
    from services.scheduler.policy.pause import make_pause_policy
    try:
        new = dataclasses.replace(SchedulerConfig(), **overrides)
        make_pause_policy(new.resolved_pause_policy, new.pause_costs)
        parse_tenant_quotas(new.tenant_quotas)
        DegradationLadder(new.ladder_config)
    except ValueError:
        return False
    return True


def _router_accepts(document: dict) -> bool:
    from services.mesh.live_settings import LiveDocument
    try:
        LiveDocument.parse(document)
    except SettingsError:
        return False
    return True


@pytest.mark.parametrize("overrides", SCHEDULER_VALUES, ids=lambda v: str(v)[:40])
def test_the_router_never_accepts_a_scheduler_value_the_scheduler_refuses(overrides):
    """A 200 the scheduler then refuses leaves it on the old version for good (``weft ps``
    flags it lagging) while the admin was told the change was made."""
    if _router_accepts({"scheduler": overrides}):
        assert _scheduler_applies(overrides)


@pytest.mark.parametrize("partitions", EXECUTOR_PARTITIONS, ids=lambda v: v[:20])
def test_the_router_never_accepts_a_partition_table_the_executor_cannot_parse(partitions):
    from services.executor.policy.credit_audit import parse_partitions
    if _router_accepts({"executor": {"tenant_partitions": partitions}}):
        parse_partitions(partitions)
