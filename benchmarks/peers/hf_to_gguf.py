"""Run llama.cpp's own ``convert_hf_to_gguf.py`` (the vendored copy build_llamacpp.py
unpacked) on a Weft test checkpoint, naming its BPE pre-tokenizer for the converter.

Why a wrapper: the converter identifies a byte-level BPE tokenizer by hashing how it
tokenizes a fixed text, and knows only published models' hashes. Weft's test tokenizer
(weft/testing/tiny_tokenizer.py) is trained on a small built-in corpus, so its hash is
unknown and the converter refuses it, although its split regex is exactly Qwen2's. This
script tells the converter "qwen2" (llama.cpp's name for that regex), sends it straight to
its byte-level BPE vocabulary path, and changes nothing else: tensors, their names and the
Q/K row permutation are the converter's own. The bench preset has 32000 embedding rows and
its tokenizer ~1,150 tokens; the rows without a token become ``[PAD<i>]`` UNUSED tokens, as
the converter does for every padded vocabulary. llama-batched-bench and the agreement check
feed token ids, so the tokenizer only has to load.

Runs in a separate process (weights.py starts it) so the converter's ``gguf`` package, the
vendored ``gguf-py``, never meets another copy imported in the caller.

    python benchmarks/peers/hf_to_gguf.py LLAMA_CPP_SRC MODEL_DIR OUT.gguf
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The split regex of weft/testing/tiny_tokenizer.py is Qwen2's; llama.cpp calls it this.
PRE_TOKENIZER = "qwen2"


def convert(llama_src: Path, model_dir: Path, out: Path) -> None:
    """Write ``out`` (f32) from the HF checkpoint ``model_dir`` with the converter in ``llama_src``."""
    sys.path.insert(0, str(llama_src))
    sys.path.insert(1, str(llama_src / "gguf-py"))
    import convert_hf_to_gguf  # the vendored script; importing it runs nothing
    from conversion.base import TextModel
    from conversion.llama import LlamaModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    # Straight to the converter's Llama 3 path (a byte-level BPE tokenizer.json): its Llama
    # set_vocab first tries SentencePiece, which needs a package Weft does not install.
    LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", "f32", "--outfile", str(out)]
    convert_hf_to_gguf.main()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("llama_src", type=Path, help="the vendored llama.cpp source dir (has convert_hf_to_gguf.py)")
    p.add_argument("model_dir", type=Path,
                   help="a Weft test checkpoint (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("out", type=Path, help="the f32 GGUF to write")
    args = p.parse_args(argv)
    convert(args.llama_src, args.model_dir, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
