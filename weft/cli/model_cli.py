"""``weft model make-tiny DIR``: write a small random-weight checkpoint in Hugging Face
format. The choices come from the torch-free ``weft/testing/presets.py``; torch is
imported only when a checkpoint is written."""
from __future__ import annotations

import argparse

from weft.testing.presets import ARCHS, DTYPE_NAMES, PRESETS, ROPE_SCALINGS


def register_model(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``weft model ...``: work with checkpoint directories."""
    model = subparsers.add_parser("model", help="work with model checkpoint directories",
                                  description="Work with Hugging Face model checkpoint directories.")
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


def _make_tiny(args: argparse.Namespace) -> int:
    from weft.testing.tiny_model import make_tiny_checkpoint  # torch: only to write one

    path = make_tiny_checkpoint(args.dir, preset=args.preset, arch=args.arch, seed=args.seed,
                                rope_scaling=args.rope_scaling, max_shard_bytes=args.max_shard_bytes,
                                dtype=args.dtype)
    print(path)  # the CLI's output is the checkpoint path, for shell pipelines
    return 0
