"""buf over protos/: lint is clean under protos/buf.yaml (default STANDARD rules, only the
wire-fixed exceptions), and no change since the previous commit breaks the wire or JSON
(WIRE_JSON). Each check is also run on a copy with a planted violation, so a clean run
means buf looked, not that it was misconfigured into silence."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROTOS = REPO / "protos"
ROUTER_PROTO = Path("weft/v1/router.proto")


def _buf() -> str:
    beside_python = Path(sys.executable).parent / "buf"  # the buf-bin dev dependency
    found = str(beside_python) if beside_python.exists() else shutil.which("buf")
    assert found, "buf not installed: pip install -e '.[dev]' (buf-bin)"
    return found


def buf(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([_buf(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _copy_protos(tmp_path: Path) -> Path:
    copy = tmp_path / "protos"
    shutil.copytree(PROTOS, copy)
    return copy


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}: update the planted violation"
    path.write_text(text.replace(old, new, 1))


def test_lint_is_clean():
    result = buf("lint", "protos")
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_reports_a_new_violation(tmp_path):
    copy = _copy_protos(tmp_path)
    _edit(copy / ROUTER_PROTO, "message GenerateRequest {", "message GenerateRequest {\n  string badName = 9999;")
    result = buf("lint", "protos", cwd=tmp_path)
    assert result.returncode != 0
    assert 'Field name "badName" should be lower_snake_case' in result.stdout


def _has_parent_commit() -> bool:
    return subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD~1"], cwd=REPO,
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_parent_commit(),
                    reason="no parent commit to compare against (shallow clone or first commit); CI clones full history")
def test_no_breaking_change_since_the_previous_commit():
    # The working tree's protos (committed or not) against HEAD~1's.
    result = buf("breaking", "protos", "--against", ".git#ref=HEAD~1,subdir=protos")
    assert result.returncode == 0, result.stdout + result.stderr


def test_breaking_reports_a_renumbered_field(tmp_path):
    copy = _copy_protos(tmp_path)
    _edit(copy / ROUTER_PROTO, "message GenerateRequest {\n  // Caller-chosen id for tracing; the router makes one when empty.\n  string request_id = 1;",
          "message GenerateRequest {\n  string request_id = 9998;")
    result = buf("breaking", str(copy), "--against", str(PROTOS))
    assert result.returncode != 0
    assert 'Previously present field "1" with name "request_id" on message "GenerateRequest"' in result.stdout
