"""The state file of a running mesh (``<state dir>/mesh.json``): what ``weft ps`` lists
and how ``weft scale`` finds the launcher's control endpoint.

Written by the launcher only, atomically (temp file + rename), mode 0600 because it
holds the control token; removed when the mesh stops.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "mesh.json"


@dataclass(frozen=True)
class Instance:
    """One running service process."""

    name: str  # "router", "executor-0", ...
    service: str  # table entry: "executor"
    role: str
    pid: int
    ports: dict[str, int]
    health_kind: str
    health_port: int
    health_path: str
    log_path: str
    # Supervision (weft/launcher/restart_policy.py): times the launcher restarted it after an unplanned
    # death, the exit status of its last death (None: never died; negative: killed by that
    # signal), and a supervisor Status value ("running", "restarting", "crash-loop", "stopped").
    restarts: int = 0
    last_exit: int | None = None
    status: str = "running"


@dataclass(frozen=True)
class MeshState:
    launcher_pid: int
    control_port: int
    control_token: str
    model_dir: str
    http_url: str
    grpc_address: str
    nats_url: str
    instances: list[Instance] = field(default_factory=list)
    # service -> {weft up flag: value} of the settings (weft/launcher/setting_flags.py) its
    # processes run with that differ from the default, from a flag or the environment.
    settings: dict[str, dict[str, str]] = field(default_factory=dict)

    def by_service(self, service: str) -> list[Instance]:
        return [i for i in self.instances if i.service == service]

    def instance(self, name: str) -> Instance:
        for inst in self.instances:
            if inst.name == name:
                return inst
        raise KeyError(name)


def state_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / STATE_FILE


def write_state(state_dir: str | Path, state: MeshState) -> None:
    path = state_path(state_dir)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(state), f, indent=2)
    os.replace(tmp, path)


def read_state(state_dir: str | Path) -> MeshState | None:
    """The recorded state, or None when no mesh was recorded there."""
    path = state_path(state_dir)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    instances = [Instance(**i) for i in raw.pop("instances", [])]
    return MeshState(**raw, instances=instances)


def remove_state(state_dir: str | Path) -> None:
    state_path(state_dir).unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
