"""The unlucky operator runs the buf checks (issue 15) where CI does not: in a shallow
clone (`git clone --depth 1`, no parent commit) the breaking-change test is skipped with a
reason that says why and the lint tests still run; in a clone with history every buf test
runs and passes. buf is the dev dependency installed beside this Python (buf-bin), which
`make test` installs from pyproject's dev extras in a fresh clone."""
from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from tests.integration.launched_mesh import ROOT


def _clone_and_test(tmp_path, *depth: str) -> subprocess.CompletedProcess:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", *depth, f"file://{ROOT}", str(clone)], check=True, timeout=300,
                   capture_output=True)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/unit/protos"],
                          cwd=clone, capture_output=True, text=True, timeout=300)


def test_a_shallow_clone_skips_only_the_breaking_check_and_says_why(tmp_path):
    out = _clone_and_test(tmp_path, "--depth", "1")
    assert out.returncode == 0, out.stdout[-3000:]
    assert "3 passed, 1 skipped" in out.stdout, out.stdout[-3000:]
    assert "no parent commit to compare against (shallow clone" in out.stdout, out.stdout[-3000:]


@pytest.mark.parametrize("depth", [("--depth", "2"), ()], ids=["depth-2", "full"])
def test_a_clone_with_history_runs_every_buf_check(tmp_path, depth):
    out = _clone_and_test(tmp_path, *depth)
    assert out.returncode == 0 and "4 passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-3000:]


def test_make_test_installs_buf_from_the_dev_extras():
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(d.replace(" ", "").startswith("buf-bin") for d in dev), dev
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q -e '.[dev]'" in makefile and "test: $(STAMP)" in makefile
