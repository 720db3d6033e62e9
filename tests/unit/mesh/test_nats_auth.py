"""NATS credentials: per-role passwords, the rendered server config, and a bus that logs
in without ever printing its password (services/mesh/nats_auth.py, nats_bus.py)."""
import asyncio

import pytest
from structlog.testing import capture_logs

from services.mesh import nats_auth
from services.mesh.nats_bus import EventBus
from services.mesh.nats_server import free_port


def test_derived_passwords_differ_per_role_and_per_master_and_suit_nats_server():
    a, b = nats_auth.derive_passwords("master-1"), nats_auth.derive_passwords("master-2")
    assert set(a) == set(nats_auth.ROLES)
    assert len(set(a.values())) == len(nats_auth.ROLES)  # one role's password says nothing of another's
    assert a == nats_auth.derive_passwords("master-1") and not set(a.values()) & set(b.values())
    for role, pw in a.items():
        nats_auth.check_password(pw, role)


@pytest.mark.parametrize("bad", ["12345678901234567890", "short-pw", "-starts-with-a-dash-x"])
def test_passwords_nats_server_would_misparse_are_refused_naming_the_variable(bad):
    with pytest.raises(ValueError, match="WEFT_NATS_EXECUTOR_PASSWORD"):
        nats_auth.server_env({"executor": bad})


def test_only_executors_may_publish_heartbeats_load_and_kv_and_only_the_router_publishes_settings():
    perms = nats_auth.role_permissions()
    publishers = {role for role, p in perms.items() if any(s.startswith("weft.heartbeat") for s in p.publish)}
    assert publishers == {"executor"}
    assert perms["cachestore"].publish == ("weft.kv.cachestore",)
    assert perms["router"] == nats_auth.Permissions(publish=("weft.settings.>", "weft.routersettings.>"),
                                                    subscribe=("weft.routersettings.>", "weft.settingswant.>"))
    readers = {role for role, p in perms.items() if any(s.startswith("weft.routersettings") for s in p.subscribe)}
    assert readers == {"router"}  # the document with the keys reaches routers only
    assert set(perms["scheduler"].subscribe) == {"weft.heartbeat.>", "weft.load.>", "weft.kv.>", "weft.settings.>"}
    settings_publishers = {role for role, p in perms.items() if any(s.startswith("weft.settings.") for s in p.publish)}
    assert settings_publishers == {"router"}
    # the followers may only ask the routers to publish (live_settings.WANT_KIND)
    askers = {role for role, p in perms.items() if "weft.settingswant.>" in p.publish}
    assert askers == {"executor", "scheduler"}
    assert perms["scheduler"].publish == ("weft.settingswant.>",)


def test_config_names_passwords_by_variable_and_denies_everything_to_a_role_with_no_subjects():
    text = nats_auth.render_config()
    for role in nats_auth.ROLES:
        assert f"password: $WEFT_NATS_{role.upper()}_PASSWORD" in text
    cachestore_line = next(line for line in text.splitlines() if '"cachestore"' in line)
    assert cachestore_line.split("subscribe")[1].count('{deny: [">"]}') == 1
    assert "tls" not in text
    tls = nats_auth.render_config(tls=nats_auth.TlsFiles("/c.pem", "/k.pem", "/ca.pem"))
    assert 'cert_file: "/c.pem"' in tls and 'key_file: "/k.pem"' in tls and 'ca_file: "/ca.pem"' in tls


def test_client_env_holds_only_the_roles_own_password():
    pw = nats_auth.derive_passwords("m")
    env = nats_auth.client_env("router", pw)
    assert env == {"WEFT_NATS_USER": "router", "WEFT_NATS_PASSWORD": pw["router"]}
    with pytest.raises(ValueError, match="unknown NATS role"):
        nats_auth.client_env("tenant", pw)


def test_client_auth_from_environ_takes_a_pair_or_a_file_and_names_what_is_wrong(tmp_path):
    assert nats_auth.ClientAuth.from_environ({}) == nats_auth.ClientAuth()
    pw_file = tmp_path / "pw"
    pw_file.write_text("  wn-secret-from-a-file\n")
    auth = nats_auth.ClientAuth.from_environ({"WEFT_NATS_USER": "executor", "WEFT_NATS_PASSWORD_FILE": str(pw_file)})
    assert auth == nats_auth.ClientAuth("executor", "wn-secret-from-a-file")
    assert "wn-secret" not in repr(auth)
    with pytest.raises(ValueError, match="WEFT_NATS_USER and WEFT_NATS_PASSWORD"):
        nats_auth.ClientAuth.from_environ({"WEFT_NATS_USER": "executor"})
    with pytest.raises(ValueError, match="not both"):
        nats_auth.ClientAuth.from_environ({"WEFT_NATS_USER": "x", "WEFT_NATS_PASSWORD": "y",
                                           "WEFT_NATS_PASSWORD_FILE": str(pw_file)})
    with pytest.raises(ValueError, match="WEFT_NATS_PASSWORD_FILE"):
        nats_auth.ClientAuth.from_environ({"WEFT_NATS_USER": "x", "WEFT_NATS_PASSWORD_FILE": str(tmp_path / "no")})


def test_redact_url_hides_the_password_only():
    assert nats_auth.redact_url("nats://executor:hunter2-long@nats:4222") == "nats://executor:***@nats:4222"
    assert nats_auth.redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def test_the_bus_never_logs_its_password_even_when_it_is_in_the_url():
    secret = "wn-very-secret-password"

    async def scenario():
        bus = EventBus(f"nats://executor:{secret}@127.0.0.1:{free_port()}", "ex-1", reconnect_wait_s=0.05,
                       auth=nats_auth.ClientAuth("executor", secret))
        with capture_logs() as logs:
            await bus.start()
            await bus.wait_connected(0.3)  # nothing listens: it logs the failure
            await bus.close()
        return logs

    logs = asyncio.run(scenario())
    assert any(entry["event"] == "nats_unreachable" for entry in logs)
    assert secret not in repr(logs)


def test_the_shipped_config_is_the_rendered_one_and_nats_server_accepts_it():
    import subprocess

    from services.mesh.nats_server import nats_server_binary

    assert nats_auth.DEFAULT_CONFIG_PATH.read_text() == nats_auth.render_config(), \
        "regenerate: python -m services.mesh.nats_auth config > services/mesh/nats.conf"
    env = nats_auth.server_env({role: nats_auth.dev_fallback_password(role) for role in nats_auth.ROLES})
    check = subprocess.run([str(nats_server_binary()), "-c", str(nats_auth.DEFAULT_CONFIG_PATH), "-t"],
                           env=env, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
