"""Issue 16, the native decode library's build cache in an unlucky operator's hands: a
truncated or foreign file under the cached name is rebuilt (it disabled the native path
at every start, or crashed the executor with AttributeError), no compiler on PATH and a
cache directory that cannot be made fall back to torch with one readable warning, and two
executors building at once end with one library and no temporaries."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from services.executor.model.native import library

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not any((Path(d) / "gcc").exists() for d in os.environ.get("PATH", "").split(":")),
                                reason="needs gcc")


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A fresh cache directory; ``load``'s per-process cache cleared before and after."""
    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("WEFT_NATIVE_CC", raising=False)
    monkeypatch.delenv("WEFT_NATIVE_DECODE", raising=False)
    library.load.cache_clear()
    yield library.cache_dir()
    library.load.cache_clear()


def cached_path(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return library.library_path("gcc", directory)


def test_a_truncated_cached_library_is_rebuilt_and_loaded(cache):
    path = cached_path(cache)
    path.write_bytes(b"\x7fELF")  # a copy cut short (disk full, a killed rsync)
    with capture_logs() as logs:
        lib = library.load()
    assert lib is not None and hasattr(lib, "weft_decode_step")
    assert path.stat().st_size > 1000
    assert [e["event"] for e in logs].count("native_decode_cache_rebuilt") == 1


def test_a_foreign_library_under_the_cached_name_never_raises_and_is_replaced(cache, tmp_path):
    path = cached_path(cache)
    source = tmp_path / "other.c"
    source.write_text("int weft_other(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    with capture_logs() as logs:
        library.load()  # this process may fall back (the foreign file stays mapped), but must not raise
    assert "native_decode_cache_rebuilt" in [e["event"] for e in logs]
    assert b"weft_decode_step" in path.read_bytes()  # the next start loads the real library


def test_no_compiler_on_path_falls_back_with_one_readable_warning(cache, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with capture_logs() as logs:
        assert library.load() is None
    warnings = [e for e in logs if e["event"] == "native_decode_unavailable"]
    assert len(warnings) == 1 and "gcc" in warnings[0]["reason"]


def test_a_cache_directory_that_cannot_be_made_falls_back(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("WEFT_CACHE_DIR", str(blocker / "cache"))  # under a regular file
    library.load.cache_clear()
    try:
        with capture_logs() as logs:
            assert library.load() is None
        assert [e["event"] for e in logs].count("native_decode_unavailable") == 1
    finally:
        library.load.cache_clear()


def test_two_executors_building_at_once_share_one_library(tmp_path):
    code = ("import sys; from pathlib import Path; from services.executor.model.native import library; "
            "print(library.build('gcc', Path(sys.argv[1])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and Path(outs[0]).stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".build.lock") == [Path(outs[0]).name]
