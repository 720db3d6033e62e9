"""Issue 17 (session 2), live settings in an unlucky operator's hands on a real mesh
(`weft up`, one executor): the scheduler and the router killed with SIGKILL right after a
change come back (restarted by the supervisor) on the new version, the router with the
key the change added; a SIGHUP while the keys file is being rewritten (empty) keeps the
old keys working and the router closed to callers without a key."""
from __future__ import annotations

import json
import os
import signal

from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh
from tests.integration.test_live_settings import ADMIN, SETTINGS, _all_run, _call, _complete, _metric
from weft.launcher.mesh_state import pid_alive, read_state


def _restarted(state_dir, name: str, old_pid: int):
    """The mesh state once ``name`` runs again under a new pid and answers on /metrics."""
    latest = read_state(state_dir)
    inst = next((i for i in latest.instances if i.name == name), None) if latest else None
    if inst is None or inst.pid == old_pid or not pid_alive(inst.pid):
        return None
    try:
        return latest if _metric(latest, name, "weft_settings_version") is not None else None
    except OSError:
        return None


def _kill(state, service: str) -> tuple[str, int]:
    inst = next(i for i in state.instances if i.service == service)
    os.kill(inst.pid, signal.SIGKILL)
    return inst.name, inst.pid


def test_killed_services_come_back_on_the_new_version_and_an_empty_keys_file_opens_nothing(tmp_path, tiny_model_dir):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{ADMIN} ops admin\nsk-acme-0001 acme\n")
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"version": 1}))
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    with launched_mesh(state_dir, tiny_model_dir, 1, check_orphans=False,
                       extra_args=["--keys-file", str(keys), "--settings", str(settings), "--num-kv-blocks", "128"]) \
            as (launcher, state):
        wait_for(lambda: _all_run(state, 1), 30, "every service to run version 1")
        status, body = _call(state.http_url, "PATCH", SETTINGS, ADMIN, {"scheduler": {"policy": "fcfs"}})
        assert status == 200 and body["version"] == 2
        name, pid = _kill(state, "scheduler")  # at once: it may not have applied version 2 yet
        state = wait_for(lambda: _restarted(state_dir, name, pid), 120, "the scheduler to be restarted")
        wait_for(lambda: _all_run(state, 2), 60, "the restarted scheduler to run version 2")

        status, body = _call(state.http_url, "PATCH", SETTINGS, ADMIN, {"keys": {"sk-new-0001": "globex"}})
        assert status == 200 and body["version"] == 3
        name, pid = _kill(state, "router")
        state = wait_for(lambda: _restarted(state_dir, name, pid), 120, "the router to be restarted")
        wait_for(lambda: _all_run(state, 3), 60, "the restarted router (and the mesh) to run version 3")
        assert _complete(state.http_url, "sk-new-0001")[0] == 200

        keys.write_text("")  # an editor halfway through a save
        os.kill(launcher.pid, signal.SIGHUP)
        log = state_dir / "launcher.log"
        wait_for(lambda: "live_settings_reload_refused" in log.read_text(errors="replace")
                 or any("live_settings_reload_refused" in p.read_text(errors="replace")
                        for p in state_dir.rglob("*.log")), 30, "the router to refuse the empty keys file")
        assert _complete(state.http_url, None)[0] == 401  # still closed
        assert _complete(state.http_url, "sk-new-0001")[0] == 200
        assert _call(state.http_url, "GET", SETTINGS, ADMIN)[1]["version"] == 3
