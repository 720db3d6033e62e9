"""Weft's model cache: where pulled and imported checkpoints live, and how one is
installed exactly once.

NOTE: the mechanism only (which checkpoint to build, and how, is the caller's:
``weft/models/sources.py``). Its invariant: a cache entry's directory exists only when it
is complete. A checkpoint is built in a scratch directory beside the entry and renamed
into place (a rename on one filesystem is atomic), under an exclusive lock file, so

    cache/models/<name>/            complete, or absent (never half-written)
    cache/models/.<name>.partial-*  a build in progress, or one a crash left (removed under the lock)
    cache/models/.<name>.lock       flock'ed while one process checks and builds

two ``weft model pull`` (or two ``weft up``) racing build it once: the second waits on
the lock, then finds the entry and returns it. A build that fails leaves nothing behind.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

CACHE_DIR_ENV = "WEFT_CACHE_DIR"
# Files whose presence makes a directory a usable entry (what every service reads first).
_ENTRY_FILES = ("config.json", "tokenizer.json")
# Written by install_once into each entry: every file's size at install time. An entry whose
# weights were deleted or truncated by hand no longer matches it and is rebuilt, instead of
# being served until an executor fails to load it.
MANIFEST = "weft-files.json"


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$WEFT_CACHE_DIR``, else ``~/.cache/weft`` (XDG's place for re-creatable data)."""
    env = os.environ if env is None else env
    configured = env.get(CACHE_DIR_ENV, "")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "weft"


def is_complete(entry: Path) -> bool:
    """Whether ``entry`` is an installed checkpoint: a directory with its config and
    tokenizer, and every file its manifest lists at the size it had when installed."""
    if not (entry.is_dir() and all((entry / name).is_file() for name in _ENTRY_FILES)):
        return False
    try:
        sizes = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:  # an entry installed before manifests
        return True
    except (OSError, ValueError):
        return False
    try:
        return all((entry / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, AttributeError, TypeError):
        return False


def _write_manifest(checkpoint: Path) -> None:
    sizes = {f.name: f.stat().st_size for f in sorted(checkpoint.iterdir()) if f.is_file() and f.name != MANIFEST}
    (checkpoint / MANIFEST).write_text(json.dumps(sizes, indent=2) + "\n")


@contextlib.contextmanager
def locked(lock_path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if absent) for the block.
    ``on_wait`` is called once, before blocking, when another holder has it: a pull of
    100 MB can take a while and the user should know why nothing happens. The kernel
    drops the lock when its holder dies, so a crashed pull never wedges the cache."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def install_once(entry: Path, build: Callable[[Path], Path],
                 on_wait: Callable[[], None] | None = None) -> tuple[Path, bool]:
    """Make ``entry`` a complete checkpoint, building it at most once.

    ``build(scratch)`` gets an empty scratch directory on the entry's filesystem (for
    downloads too) and returns the finished checkpoint directory inside it, which is then
    renamed to ``entry``. Returns ``(entry, built)``: ``built`` is False when the entry was
    already there (a no-op, also after waiting for a concurrent build). A ``build`` that
    raises leaves no trace; its exception propagates.
    """
    if is_complete(entry):
        return entry, False
    with locked(entry.parent / f".{entry.name}.lock", on_wait):
        if is_complete(entry):  # another process built it while this one waited
            return entry, False
        for stale in entry.parent.glob(f".{entry.name}.partial-*"):  # a crashed build's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        if entry.exists():  # incomplete (files deleted by hand): rebuilt, not trusted
            log.warning("model_cache_entry_incomplete", entry=str(entry))
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=entry.parent))
        try:
            built = build(scratch)
            if not is_complete(built):
                raise RuntimeError(f"building {entry.name} produced no checkpoint in {built}")
            _write_manifest(built)
            os.replace(built, entry)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    log.info("model_cache_entry_installed", entry=str(entry))
    return entry, True
