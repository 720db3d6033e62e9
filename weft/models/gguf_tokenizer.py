"""A Hugging Face ``tokenizer.json`` (+ its ``tokenizer_config.json`` keys) from the
vocabulary a GGUF file carries.

NOTE: GGUF stores a byte-level BPE vocabulary as three arrays — ``tokenizer.ggml.tokens``
(id → token string, already in GPT-2's byte-to-unicode alphabet), ``tokenizer.ggml.merges``
("a b" pairs, in rank order) and ``tokenizer.ggml.token_type`` (1 normal, 3 control,
4 user-defined) — plus ``tokenizer.ggml.pre``, the name of the pre-tokenizer llama.cpp
applies before BPE. Only the pre-tokenizers listed in ``PRE_TOKENIZERS`` are rebuilt here
(each one checked against transformers' own GGUF loader in the tests); any other name is
a ``GgufImportError`` naming it, never a tokenizer that splits text differently.

SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``) are not supported yet.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# llama.cpp's pre-tokenizer name → the tokenizers pre-tokenizer that splits text the same way.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    # GPT-2's regex on bytes.
    "gpt2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
    # SmolLM / StarCoder: every digit is its own piece, then GPT-2's regex.
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "starcoder": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
}
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 3, 4


class GgufImportError(ValueError):
    """The GGUF file uses something this importer does not support; the message names it."""


def build_tokenizer_json(model: str, pre: str, tokens: Sequence[str], merges: Sequence[str],
                         token_types: Sequence[int], bos_id: int | None = None) -> dict[str, Any]:
    """tokenizer.json for a byte-level BPE GGUF vocabulary; ``bos_id`` (the GGUF's
    ``add_bos_token`` was set): every encoding starts with it, as llama.cpp's does. Pure."""
    if model != "gpt2":
        raise GgufImportError(f"tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', "
                              "byte-level BPE)")
    if pre not in PRE_TOKENIZERS:
        raise GgufImportError(f"tokenizer.ggml.pre {pre!r} is not supported (supported: "
                              f"{sorted(PRE_TOKENIZERS)})")
    if len(token_types) not in (0, len(tokens)):
        raise GgufImportError("tokenizer.ggml.token_type must have one entry per token")
    types = list(token_types) or [TOKEN_TYPE_NORMAL] * len(tokens)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == TOKEN_TYPE_CONTROL}
             for i, t in enumerate(tokens) if types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": _bos_template(tokens[bos_id], bos_id) if bos_id is not None else None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }


def _bos_template(bos: str, bos_id: int) -> dict[str, Any]:
    """A post-processor that puts ``bos`` before every sequence (and each of a pair)."""
    piece = {"SpecialToken": {"id": bos, "type_id": 0}}
    return {
        "type": "TemplateProcessing",
        "single": [piece, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [piece, {"Sequence": {"id": "A", "type_id": 0}}, piece, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def special_token_names(tokens: Sequence[str], ids: dict[str, int | None]) -> dict[str, str]:
    """``{"bos_token": "<|im_start|>", ...}`` for the ids the GGUF names (None: absent)."""
    out = {}
    for key, i in ids.items():
        if i is not None:
            if not 0 <= i < len(tokens):
                raise GgufImportError(f"tokenizer.ggml.{key}_id {i} is outside the vocabulary ({len(tokens)})")
            out[f"{key}_token"] = tokens[i]
    return out
