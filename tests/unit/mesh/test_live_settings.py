"""Live settings without processes: the document (validation names the field, merge patch,
no keys on the bus), the router's writer (versions, 409, SIGHUP reload, files written back),
the admin API's auth (401 / 403 / 400 / 409), a service's follower (applies, refuses, reports
its version) and the NATS permission that only the router may publish the document."""
import asyncio
import json

import pytest
from aiohttp import web
from structlog.testing import capture_logs
from aiohttp.test_utils import TestClient, TestServer

from services.mesh import nats_auth
from services.mesh.live_settings import LiveDocument, SettingsError, SettingsFollower, merge_patch
from services.router.admin_routes import AdminRoutes
from services.router.auth import KeyStore
from services.router.errors import AuthenticationError
from services.router.live_settings import LiveOptions, RouterLiveSettings, VersionConflict


@pytest.fixture(autouse=True)
def _logs():
    with capture_logs() as logs:  # another test may have bound structlog to a closed stream
        yield logs


@pytest.mark.parametrize("doc, field", [
    ({"scheduler": {"policy": "lifo"}}, "scheduler.policy"),
    ({"scheduler": {"executor_overcommit": 0.5}}, "scheduler.executor_overcommit"),
    ({"scheduler": {"tenant_quotas": "acme:64"}}, "scheduler.tenant_quotas"),
    ({"scheduler": {"degradation_thresholds": "shed=0.5:0.9"}}, "scheduler.degradation_thresholds"),
    ({"scheduler": {"degradation_rungs": "none,turbo"}}, "scheduler.degradation_rungs"),
    ({"scheduler": {"max_in_flight": 3}}, "scheduler.max_in_flight"),  # restart-only
    ({"executor": {"tenant_partitions": "acme=32"}}, "executor.tenant_partitions"),
    ({"keys": {"sk-aaaa": {"tenant": "a", "role": "root"}}}, "keys.sk-a….role"),
    ({"router": {}}, "router"),
    ({"version": -1}, "version"),
])
def test_a_bad_document_is_refused_naming_the_field(doc, field):
    with pytest.raises(SettingsError) as err:
        LiveDocument.parse(doc)
    assert err.value.field == field


def test_merge_patch_null_returns_a_setting_to_its_flag_and_the_bus_never_carries_keys():
    doc = LiveDocument.parse({"version": 3, "keys": {"sk-secret": "acme"},
                              "scheduler": {"policy": "fcfs", "tenant_quotas": "acme=8"}})
    new = doc.merged({"scheduler": {"policy": None, "executor_overcommit": 2}})
    assert dict(new.sections["scheduler"]) == {"tenant_quotas": "acme=8", "executor_overcommit": 2}
    assert b"sk-secret" not in new.bus_payload() and b"keys" not in new.bus_payload()
    assert merge_patch({"a": {"b": 1, "c": 2}}, {"a": {"b": None}}) == {"a": {"c": 2}}


def _router(tmp_path, keys=None, settings=None) -> RouterLiveSettings:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(keys or {"sk-admin": {"tenant": "ops", "role": "admin"}, "sk-acme": "acme"}))
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps(settings or {}))
    store = KeyStore.from_file(keys_file)
    return RouterLiveSettings(store, str(keys_file), LiveOptions(settings_file=str(settings_file)))


def test_a_patch_bumps_the_version_swaps_the_keys_and_is_written_back(tmp_path):
    live = _router(tmp_path)
    assert live.document.version == 1
    doc = live.patch({"keys": {"sk-new": "globex"}, "scheduler": {"policy": "priority"}}, expected_version=1)
    assert doc.version == 2 and live.keys.authenticate("sk-new") == "globex"
    assert json.loads((tmp_path / "settings.json").read_text()) == {"version": 2, "scheduler": {"policy": "priority"}}
    assert "sk-new" in json.loads((tmp_path / "keys.json").read_text())
    live.patch({"keys": {"sk-acme": None}})
    with pytest.raises(AuthenticationError):
        live.keys.authenticate("sk-acme")


def test_a_stale_version_or_a_bad_value_changes_nothing(tmp_path):
    live = _router(tmp_path)
    live.patch({"scheduler": {"policy": "fcfs"}})
    with pytest.raises(VersionConflict):
        live.patch({"scheduler": {"policy": "weft"}}, expected_version=1)
    with pytest.raises(VersionConflict):
        live.patch({"version": 1, "scheduler": {"policy": "weft"}})
    with pytest.raises(SettingsError):
        live.patch({"keys": {"sk-x": "x"}, "scheduler": {"pause_policy": "sometimes"}})
    assert live.document.version == 2 and dict(live.document.sections["scheduler"]) == {"policy": "fcfs"}
    with pytest.raises(AuthenticationError):
        live.keys.authenticate("sk-x")


def test_reload_reads_both_files_and_a_bad_file_keeps_the_running_document(tmp_path):
    live = _router(tmp_path)
    (tmp_path / "keys.json").write_text("sk-admin ops admin\nsk-late late\n")
    (tmp_path / "settings.json").write_text(json.dumps({"version": 9, "executor": {"tenant_partitions": "a=1:1"}}))
    assert live.reload().version == 9 and live.keys.authenticate("sk-late") == "late"
    (tmp_path / "settings.json").write_text(json.dumps({"scheduler": {"policy": "x"}}))
    with pytest.raises(SettingsError):
        live.reload()
    assert live.document.version == 9


def test_keys_file_roles_make_admins_and_an_open_store_has_none(tmp_path):
    (tmp_path / "k").write_text("sk-a acme\nsk-o ops admin\n")
    store = KeyStore.from_file(tmp_path / "k")
    assert store.is_admin("sk-o") and not store.is_admin("sk-a")
    with pytest.raises(AuthenticationError):
        store.is_admin("sk-unknown")
    assert not KeyStore({}).is_admin("anything")


def test_admin_api_auth_bad_values_and_version_races(tmp_path):
    live = _router(tmp_path)

    async def scenario():
        app = web.Application()
        AdminRoutes(live).register(app)
        async with TestClient(TestServer(app)) as client:
            path = "/v1/weft/admin/settings"
            admin, tenant = {"Authorization": "Bearer sk-admin"}, {"Authorization": "Bearer sk-acme"}
            assert (await client.get(path)).status == 401
            assert (await client.get(path, headers=tenant)).status == 403
            assert (await client.patch(path, headers=tenant, json={"scheduler": {"policy": "fcfs"}})).status == 403
            got = await client.get(path, headers=admin)
            body = await got.json()
            assert got.status == 200 and body["version"] == 1 and "sk-admin" not in json.dumps(body)
            bad = await client.patch(path, headers=admin, json={"scheduler": {"max_pinned_fraction": 2}})
            assert bad.status == 400 and (await bad.json())["error"]["param"] == "scheduler.max_pinned_fraction"
            ok = await client.patch(path, headers={**admin, "If-Match": "1"}, json={"scheduler": {"policy": "fcfs"}})
            assert ok.status == 200 and (await ok.json())["version"] == 2
            race = await client.patch(path, headers={**admin, "If-Match": "1"}, json={"scheduler": {"policy": "weft"}})
            assert race.status == 409

    asyncio.run(scenario())


def test_a_follower_applies_its_section_reports_the_version_and_refuses_atomically():
    applied, attempts = [], []

    def apply(overrides):
        attempts.append(overrides)
        if overrides.get("tenant_partitions") == "a=999:0":
            raise ValueError("reserved blocks of all partitions exceed the pool")
        applied.append(overrides)

    follower = SettingsFollower("executor", "executor", apply)

    def doc(version, partitions=None):
        return LiveDocument.parse({"version": version, **({"executor": {"tenant_partitions": partitions}}
                                                          if partitions else {})}).bus_payload()

    asyncio.run(follower.receive(doc(2, "a=4:2")))
    asyncio.run(follower.receive(doc(2, "a=4:2")))  # the periodic republish: nothing to do
    asyncio.run(follower.receive(doc(3, "a=999:0")))
    assert applied == [{"tenant_partitions": "a=4:2"}] and follower.version == 2
    asyncio.run(follower.receive(doc(3, "a=999:0")))  # republished: refused again (tried on each republish)
    assert len(applied) == 1 and len(attempts) == 3 and follower.version == 2
    asyncio.run(follower.receive(doc(4)))  # the override removed: back to the flag's value
    assert applied[-1] == {} and follower.version == 4
    # A router restarted with no settings file counts from 1, and claims its document now.
    restarted = LiveDocument.parse({"version": 1, "updated_at": 1e9, "executor": {"tenant_partitions": "b=2:2"}})
    asyncio.run(follower.receive(restarted.bus_payload()))
    assert applied[-1] == {"tenant_partitions": "b=2:2"} and follower.version == 1


def test_only_the_router_may_publish_the_settings_document_and_the_followers_read_it():
    perms = nats_auth.role_permissions()
    publishers = {role for role, p in perms.items() if "weft.settings.>" in p.publish}
    assert publishers == {"router"}
    assert "weft.settings.>" in perms["scheduler"].subscribe and "weft.settings.>" in perms["executor"].subscribe
    assert perms["router"].subscribe == ("weft.routersettings.>", "weft.settingswant.>")
    assert not perms["cachestore"].subscribe


def test_ps_and_top_flag_a_service_behind_the_newest_version():
    from weft.cli.top import settings_versions_text

    text = settings_versions_text({"router": 5.0, "scheduler": 5.0, "executor-0": 4.0, "executor-1": None})
    assert text == "live settings version 5: router v5, scheduler v5, executor-0 v4 LAGGING, executor-1 ?"
