"""A sound bound on how many characters of text can fit the model's context, so a prompt
that can never fit is refused before it is tokenized.

NOTE: why the bound is sound. A tokenizer pipeline is normalizer -> pre-tokenizer ->
model. If no stage can drop characters, every token covers at most
``max_chars_per_token`` characters of the normalized text (the longest vocabulary
entry: byte-level entries are one char per byte and a char is at least one byte,
``<0x0A>`` byte-fallback entries are longer than the byte they stand for, added tokens
count by their content), and normalization shrinks text by at most ``max_shrink`` (NFC /
NFKC compose at most 4 code points into 1; ASCII text is already composed). Hence

    num_tokens >= num_chars / (max_chars_per_token * shrink)
    num_chars > max_model_len * max_chars_per_token * shrink   =>   it cannot fit.

A stage that can drop characters without bound (whitespace-splitting pre-tokenizers,
``Strip``, ``Replace`` with "", fused unknown tokens, WordPiece's one ``[UNK]`` per word)
makes the bound unsound: ``max_chars_per_token`` is then None and no text is refused
early (the tokenizer still runs off the event loop; ``generation.py``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# NFC / NFKC compose at most this many code points into one (canonical decompositions
# are at most 4 long, e.g. U+1F87 GREEK SMALL LETTER ALPHA WITH DASIA AND PERISPOMENI
# AND YPOGEGRAMMENI).
_MAX_COMPOSITION = 4
_COMPOSING = {"NFC", "NFKC"}
_NON_SHRINKING = {"NFD", "NFKD", "Lowercase", "Prepend"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


@dataclass(frozen=True)
class CharBudget:
    """``max_chars_per_token``: None when the pipeline may drop characters (no bound).
    ``max_shrink`` applies to non-ASCII text, ``ascii_shrink`` to ASCII text."""

    max_chars_per_token: int | None
    max_shrink: int = 1
    ascii_shrink: int = 1

    def max_chars(self, max_model_len: int, is_ascii: bool) -> int | None:
        """Most characters a text can have and still fit ``max_model_len`` tokens."""
        if self.max_chars_per_token is None:
            return None
        return max_model_len * self.max_chars_per_token * (self.ascii_shrink if is_ascii else self.max_shrink)


def char_budget(spec: Mapping[str, Any], vocab: Iterable[str]) -> CharBudget:
    """The budget of a ``tokenizer.json`` document (``spec``) and its vocabulary
    (added tokens included)."""
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps(spec.get("pre_tokenizer")) or not _model_keeps(spec):
        return CharBudget(None)
    ascii_shrink, max_shrink = shrink
    return CharBudget(max((len(t) for t in vocab), default=1) or 1, max_shrink, ascii_shrink)


def _normalizer_shrink(n: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """(shrink for ASCII text, shrink for any text), or None when it may drop characters."""
    if n is None:
        return 1, 1
    kind = n.get("type")
    if kind == "Sequence":
        ascii_total, total = 1, 1
        for part in n.get("normalizers") or ():
            s = _normalizer_shrink(part)
            if s is None:
                return None
            ascii_total, total = ascii_total * s[0], total * s[1]
        return ascii_total, total
    if kind in _COMPOSING:
        return 1, _MAX_COMPOSITION
    if kind in _NON_SHRINKING:
        return 1, 1
    if kind == "Replace":
        pattern, content = (n.get("pattern") or {}).get("String"), n.get("content")
        if not isinstance(pattern, str) or not isinstance(content, str) or not content:
            return None  # a regex, or replacing with nothing: unbounded
        s = max(1, math.ceil(len(pattern) / len(content)))
        return s, s
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, unknown kinds


def _pre_tokenizer_keeps(p: Mapping[str, Any] | None) -> bool:
    if p is None:
        return True
    kind = p.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(part) for part in p.get("pretokenizers") or ())
    return kind in _KEEPING_PRE_TOKENIZERS and p.get("behavior") != "Removed"


def _model_keeps(spec: Mapping[str, Any]) -> bool:
    """Every character ends up in some token: byte-level BPE (a complete byte alphabet),
    byte fallback, or one unfused unknown token per unknown character."""
    model = spec.get("model") or {}
    if model.get("byte_fallback"):
        return True
    if model.get("type") != "BPE":
        return False  # WordPiece / WordLevel: one [UNK] per word; Unigram fuses unknowns
    if _has_byte_level(spec.get("pre_tokenizer")):
        return True
    return bool(model.get("unk_token")) and not model.get("fuse_unk")


def _has_byte_level(p: Mapping[str, Any] | None) -> bool:
    if p is None:
        return False
    if p.get("type") == "Sequence":
        return any(_has_byte_level(part) for part in p.get("pretokenizers") or ())
    return p.get("type") == "ByteLevel"
