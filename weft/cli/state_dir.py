"""The ``--state-dir`` every command on a running mesh takes, and how a command finds
that mesh: the state file the launcher writes (``weft/launcher/mesh_state.py``), only
while its launcher process lives."""
from __future__ import annotations

import argparse
import os
import sys

from weft.launcher.mesh_state import MeshState, pid_alive, read_state

DEFAULT_STATE_DIR = os.environ.get("WEFT_STATE_DIR", ".weft")


def add_state_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                        help="where the mesh keeps its state file, logs and the generated tiny model "
                             "[env WEFT_STATE_DIR; default: %(default)s]")


def running_mesh(state_dir: str) -> MeshState | None:
    """The state of the mesh whose launcher still runs from ``state_dir``; else None, after
    printing one line to stderr saying so."""
    state = read_state(state_dir)
    if state is None or not pid_alive(state.launcher_pid):
        print(f"no mesh running (no live launcher recorded in {state_dir})", file=sys.stderr)
        return None
    return state
