"""Build, cache and load the native decode library (``decode.c``: one sequence,
``decode_batch.c``: several; ``llama_step.h`` what both share; ``argmax.c``: greedy
sampling; ``gemm.c``: the packed AVX2 GEMM of prefills and wide decode steps; ``rows.c``:
RMSNorm and RoPE over a prefill's rows), or say why not.

The C sources are compiled at first use with the system C compiler into
``$WEFT_CACHE_DIR/native/`` (default ``~/.cache/weft/native/``), named by a hash of the
source, the flags, the compiler and the CPU, so a changed source, flag or machine builds
anew and an unchanged one loads in milliseconds. Concurrent builders (several executors
starting at once) serialise on a file lock; the library is written under a temporary
name and renamed into place, so nobody loads a half-written file.

Any failure (no compiler, a compile error, an odd CPU, a library that does not load)
logs one ``native_decode_unavailable`` warning and returns None: the caller keeps the
torch path. ``WEFT_NATIVE_DECODE=0`` turns the native path off before anything is
built; ``WEFT_NATIVE_CC`` names the compiler (default ``gcc``).
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("decode.c", "decode_batch.c", "argmax.c", "gemm.c", "rows.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("llama_step.h", "gemm_packed.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_BUILD_TIMEOUT_S = 120


def native_enabled(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """False when ``WEFT_NATIVE_DECODE`` is 0/false/off/no (the one environment switch)."""
    return environ.get("WEFT_NATIVE_DECODE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir(environ: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    root = environ.get("WEFT_CACHE_DIR") or str(Path.home() / ".cache" / "weft")
    return Path(root) / "native"


def _cpu_signature() -> str:
    """The CPU model and feature flags (-march=native compiles for exactly these)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "flags", "Features", "CPU part") and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return platform.machine() + repr(sorted(fields.items()))


def library_path(compiler: str, directory: Path) -> Path:
    digest = hashlib.sha256()
    sources = [p.read_bytes() for p in SOURCES + HEADERS]
    for part in (*sources, " ".join(FLAGS).encode(), compiler.encode(), _cpu_signature().encode()):
        digest.update(part)
        digest.update(b"\0")
    return directory / f"decode-{digest.hexdigest()[:16]}.so"


def build(compiler: str, directory: Path) -> Path:
    """The compiled library's path, compiling it first unless the cache holds it.
    Raises OSError / subprocess.CalledProcessError / TimeoutExpired on failure."""
    target = library_path(compiler, directory)
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if target.exists():  # another process built it while we waited
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=directory)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], check=True,
                           capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.weft_gemv.argtypes = [p, p, p, p, i32, i32, i32]
    lib.weft_gemv.restype = None
    lib.weft_decode_step.argtypes = [p, i64, i64, i64, p, i32, p, i32]
    lib.weft_decode_step.restype = ctypes.c_int
    lib.weft_decode_rows.argtypes = [p, i32, p, p, p, p, i32, p, p, i32]
    lib.weft_decode_rows.restype = ctypes.c_int
    lib.weft_attend_rows.argtypes = [p, p, i32, p, i32, p, i32, p, i32, p, i32]
    lib.weft_attend_rows.restype = ctypes.c_int
    lib.weft_argmax_rows.argtypes = [p, i32, i32, p, i32]
    lib.weft_argmax_rows.restype = ctypes.c_int
    lib.weft_argmax_entropy_rows.argtypes = [p, i32, i32, p, p, p, i32]
    lib.weft_argmax_entropy_rows.restype = ctypes.c_int
    lib.weft_gemm_packed_available.argtypes = []
    lib.weft_gemm_packed_available.restype = ctypes.c_int
    lib.weft_pack_panels.argtypes = [p, i32, i32, p]
    lib.weft_pack_panels.restype = None
    lib.weft_pack_gate_up.argtypes = [p, i32, i32, p]
    lib.weft_pack_gate_up.restype = None
    lib.weft_gemm_packed.argtypes = [p, p, p, i32, p, i32, i32, i32, i32, i32, i32]
    lib.weft_gemm_packed.restype = None
    lib.weft_gate_up_packed.argtypes = [p, p, i32, p, i32, i32, i32, i32, i32]
    lib.weft_gate_up_packed.restype = None
    lib.weft_rms_norm_rows.argtypes = [p, p, p, i32, i32, ctypes.c_float, i32]
    lib.weft_rms_norm_rows.restype = None
    lib.weft_rope_rows.argtypes = [p, i32, p, p, p, i32, i32, i32, i32]
    lib.weft_rope_rows.restype = None
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The loaded native library, or None (disabled, or it could not be built/loaded:
    one warning says why). Cached per process; torch is loaded first so the library's
    libgomp.so.1 resolves to the one torch already mapped (one OpenMP pool)."""
    if not native_enabled():
        log.info("native_decode_disabled", reason="WEFT_NATIVE_DECODE=0")
        return None
    import torch  # noqa: F401  (its libgomp must be mapped before ours is loaded)

    compiler = os.environ.get("WEFT_NATIVE_CC", "gcc")
    try:
        path = build(compiler, cache_dir())
        try:
            return _declare(ctypes.CDLL(str(path)))
        except (OSError, AttributeError) as e:  # a truncated or foreign file under our name
            # Build it anew once, or it would disable the native path at every start. A
            # foreign library that did load keeps its name mapped in this process, so this
            # process may still fall back; the next start loads the rebuilt file.
            log.warning("native_decode_cache_rebuilt", path=str(path), reason=f"{type(e).__name__}: {e}")
            path.unlink(missing_ok=True)
            return _declare(ctypes.CDLL(str(build(compiler, cache_dir()))))
    except subprocess.CalledProcessError as e:
        reason = f"{compiler} failed: {(e.stderr or '').strip()[-400:]}"
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        reason = f"{type(e).__name__}: {e}"
    log.warning("native_decode_unavailable", reason=reason, fallback="torch decode path")
    return None
