"""Build llama.cpp once, from the ``llama-cpp-python`` source package, as a benchmark peer.

The source package on PyPI vendors a pinned llama.cpp (``vendor/llama.cpp``); building that
copy gives a known version through the ordinary package registry, with no git checkout.
Layout under the cache (``$WEFT_CACHE_DIR`` or ``~/.cache/weft``)::

    peers/src/llama_cpp_python-<version>.tar.gz      the downloaded source package
    peers/llama.cpp-<version>/src/                   it, unpacked
    peers/llama.cpp-<version>/build/bin/llama-*      the binaries (CPU only, Release, native)
    peers/llama.cpp-<version>/build.log              compiler output

A build whose binaries are all there is not redone (``--force`` to redo it). It takes
3.5 minutes with -j2 on this machine (up to ~25 on slower cores), which is why it is a script and never part of ``make test``.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-python"
# What the harness uses; a name absent from the vendored version (they get renamed) is skipped.
TARGETS = ("llama-batched-bench", "llama-quantize", "llama-server", "llama-cli")
# CPU only, no network code: the peer runs on the same cores as Weft and fetches nothing.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
               "-DGGML_VULKAN=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF")


def cache_dir() -> Path:
    return Path(os.environ.get("WEFT_CACHE_DIR") or Path.home() / ".cache" / "weft")


def peers_dir(root: Path | None = None) -> Path:
    return (root or cache_dir()) / "peers"


def say(msg: str) -> None:
    print(f"[build_llamacpp] {msg}", file=sys.stderr, flush=True)


def installed_builds(root: Path | None = None) -> list[Path]:
    """``llama.cpp-<version>`` directories, newest version last."""
    def key(p: Path):
        return [int(x) if x.isdigit() else x for x in re.split(r"[.-]", p.name.split("-", 1)[1])]
    return sorted(peers_dir(root).glob("llama.cpp-*[0-9]"), key=key)


def find_binary(name: str, root: Path | None = None) -> Path:
    """The newest built ``name`` (e.g. ``llama-batched-bench``); a clear error when none is."""
    for build in reversed(installed_builds(root)):
        path = build / "build" / "bin" / name
        if path.exists():
            return path
    raise SystemExit(f"no {name} under {peers_dir(root)}: run `python benchmarks/peers/build_llamacpp.py` first")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", default=None,
                   help=f"the {PACKAGE} version to build (default: an existing complete build if there "
                        "is one, else the newest on the package index)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="cache root (default: $WEFT_CACHE_DIR or ~/.cache/weft); the build goes under <it>/peers/")
    p.add_argument("-j", "--jobs", type=int, default=2, help="parallel compile jobs (default: 2)")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), metavar="TARGET",
                   help=f"cmake targets to build (default: {' '.join(TARGETS)}); names the vendored "
                        "version does not define are skipped with a note")
    p.add_argument("--cmake-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the cmake configure step (repeatable), e.g. -DGGML_NATIVE=OFF")
    p.add_argument("--force", action="store_true", help="configure and build again even if the binaries exist")
    p.add_argument("--print-dir", action="store_true", help="print the build's bin/ directory on stdout when done")
    return p.parse_args(argv)


def check_tools() -> None:
    """cmake, a C/C++ compiler and make must be on PATH; say how to get them if not."""
    missing = [t for t in ("cmake", "cc", "c++", "make") if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"missing build tools: {', '.join(missing)}. On Debian/Ubuntu, as root: "
                         "`apt-get update && apt-get install -y cmake build-essential`")


def download_sdist(version: str | None, dest: Path) -> Path:
    """``pip download --no-deps --no-binary :all: llama-cpp-python[==version]`` into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    if version:
        existing = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
        if existing:
            return existing[0]
    req = f"{PACKAGE}=={version}" if version else PACKAGE
    say(f"downloading the {req} source package into {dest}")
    before = set(dest.glob("*.tar.gz"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-input",
           "--disable-pip-version-check", req, "-d", str(dest)]
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"pip could not download {req} (exit {done.returncode})")
    found = sorted(set(dest.glob("*.tar.gz")) - before) or sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if version:
        found = [f for f in found if f.name == f"llama_cpp_python-{version}.tar.gz"]
    if not found:
        raise SystemExit(f"pip download of {req} left no source archive in {dest}")
    return found[-1]


def sdist_version(archive: Path) -> str:
    match = re.fullmatch(r"llama_cpp_python-(.+)\.tar\.gz", archive.name)
    if not match:
        raise SystemExit(f"unexpected source archive name: {archive.name}")
    return match.group(1)


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack ``archive`` to ``dest`` (the archive's single top directory renamed); kept if there."""
    if (dest / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        return dest
    say(f"unpacking {archive.name}")
    scratch = dest.parent / (dest.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(scratch, filter="data")
    (top,) = list(scratch.iterdir())
    shutil.rmtree(dest, ignore_errors=True)
    top.rename(dest)
    scratch.rmdir()
    return dest


def defined_targets(source: Path, wanted: list[str]) -> list[str]:
    """The names in ``wanted`` that some CMakeLists.txt of ``source`` defines."""
    text = "\n".join(p.read_text(errors="replace") for p in source.rglob("CMakeLists.txt"))
    have = [t for t in wanted if re.search(rf"(set\(TARGET|add_executable\()\s*{re.escape(t)}[\s)]", text)]
    for t in wanted:
        if t not in have:
            say(f"note: this llama.cpp defines no target {t}; skipped")
    return have


def run_logged(cmd: list[str], log: Path, label: str) -> None:
    """Run ``cmd`` with its output appended to ``log``; print cmake's [ NN%] progress lines."""
    say(f"{label}: {' '.join(cmd)}  (log: {log})")
    t0 = time.monotonic()
    with open(log, "a") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        last = ""
        for line in proc.stdout:
            sink.write(line)
            pct = re.match(r"\[\s*(\d+)%\]", line)
            if pct and pct.group(1) != last:
                last = pct.group(1)
                say(f"{label} {last:>3}%  ({time.monotonic() - t0:.0f} s)")
        if proc.wait() != 0:
            raise SystemExit(f"{label} failed (exit {proc.returncode}); see {log}")


def build(args) -> Path:
    root = peers_dir(args.cache_dir)
    if args.version is None and not args.force:
        for existing in reversed(installed_builds(args.cache_dir)):
            if all((existing / "build" / "bin" / t).exists() for t in ("llama-batched-bench", "llama-quantize")):
                say(f"already built: {existing / 'build' / 'bin'} (--version or --force to build another)")
                return existing / "build" / "bin"
    check_tools()
    archive = download_sdist(args.version, root / "src")
    version = sdist_version(archive)
    home = root / f"llama.cpp-{version}"
    bin_dir = home / "build" / "bin"
    source = unpack(archive, home / "src") / "vendor" / "llama.cpp"
    targets = defined_targets(source, args.targets)
    if not args.force and targets and all((bin_dir / t).exists() for t in targets):
        say(f"already built: {bin_dir}")
        return bin_dir
    log = home / "build.log"
    configure = ["cmake", "-S", str(source), "-B", str(home / "build"), *CMAKE_FLAGS, *args.cmake_arg]
    run_logged(configure, log, "configure")
    compile_ = ["cmake", "--build", str(home / "build"), "--config", "Release", "-j", str(args.jobs),
                "--target", *targets]
    run_logged(compile_, log, "build")
    missing = [t for t in targets if not (bin_dir / t).exists()]
    if missing:
        raise SystemExit(f"build finished without {', '.join(missing)} in {bin_dir}; see {log}")
    say(f"built llama.cpp {version}: {', '.join(targets)} in {bin_dir}")
    return bin_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    bin_dir = build(args)
    if args.print_dir:
        print(bin_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
