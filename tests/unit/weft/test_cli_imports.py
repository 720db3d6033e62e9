"""The command line stays light: `weft --help`, `weft ps`, `weft top --help` and the other
commands that only print or talk to a running mesh never import torch (a second or more
of start-up, 2-3.6 s before the CLI was split from the test-model writers). Each case runs
`python -m weft ...` in a fresh interpreter and reports what it had imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weft.launcher.mesh_state import MeshState, write_state

ROOT = Path(__file__).resolve().parents[3]

# Runs `python -m weft ARGS` in-process (as runpy does for -m), then prints the exit code
# and whether heavy modules were imported, as JSON on the last line.
_PROBE = """
import json, runpy, sys
sys.argv = ["weft", *json.loads(sys.argv[1])]
code = 0
try:
    runpy.run_module("weft", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "services.executor": any(
    m.startswith("services.executor") for m in sys.modules)}))
"""


def _weft(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(args))], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [
    ("--help",), ("ps", "--help"), ("top", "--help"), ("up", "--help"), ("scale", "--help"),
    ("chaos", "--help"), ("model", "make-tiny", "--help"), ("bench", "--help"),
])
def test_help_does_not_import_torch(args):
    result = _weft(*args)
    assert result == {"code": 0, "torch": False, "services.executor": False}


def test_ps_scale_chaos_and_top_without_a_mesh_do_not_import_torch(tmp_path):
    for args in (("ps",), ("scale", "executor=2"), ("chaos", "kill", "executor-0"), ("top", "--once")):
        result = _weft(*args, "--state-dir", str(tmp_path))
        assert result == {"code": 1, "torch": False, "services.executor": False}, args


def test_ps_and_top_of_a_running_mesh_do_not_import_torch(tmp_path):
    """A recorded mesh whose launcher is alive (this test process) and has no instances:
    ps reaches its probing code (grpc, aiohttp) and top its scraping, both without torch."""
    write_state(tmp_path, MeshState(launcher_pid=os.getpid(), control_port=1, control_token="t", model_dir="m",
                                    http_url="http://127.0.0.1:1", grpc_address="", nats_url=""))
    for args in (("ps",), ("top", "--once")):
        result = _weft(*args, "--state-dir", str(tmp_path))
        assert result == {"code": 0, "torch": False, "services.executor": False}, args


def test_make_tiny_still_writes_a_checkpoint(tmp_path):
    """The one command that needs torch still gets it (imported by its handler)."""
    result = _weft("model", "make-tiny", str(tmp_path / "m"))
    assert result["code"] == 0 and result["torch"] is True
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "model.safetensors").is_file()
