"""xgrammar's view of the executor's checkpoint tokenizer.

Built from ``tokenizer.json`` with the ``tokenizers`` package (no transformers at run
time). The mask is as wide as the model's logits (config ``vocab_size``, which may exceed
the tokenizer's ids: padded embedding rows are never allowed), and the grammar's stop
tokens are the model's EOS ids, the same ones that end a free-text request.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import xgrammar as xgr
from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer_info(model_dir: str | Path, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """TokenizerInfo of ``model_dir``'s tokenizer.json; raises FileNotFoundError when the
    checkpoint has none (constrained decoding then cannot be offered)."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; constrained decoding needs the checkpoint's tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    # Special added tokens ("<|im_start|>") would otherwise match their literal text inside
    # a JSON string; as empty strings xgrammar never allows them. The EOS ids stay allowed
    # as the grammar's stop tokens. Ids the tokenizer lacks (padding rows of the embedding)
    # are empty too; ids past the model's logits cannot be sampled, so are dropped.
    special = {idx for idx, added in tokenizer.get_added_tokens_decoder().items() if added.special}
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size and idx not in special:
            encoded[idx] = token
    # Byte-level BPE ("Ġ" for a space), byte fallback ("<0x0A>") or raw pieces, and whether a
    # space is prepended: read off the tokenizer's own pipeline, as xgrammar does for HF.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    return xgr.TokenizerInfo(
        encoded, meta["vocab_type"], vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids) or None, add_prefix_space=meta["add_prefix_space"],
    )
