"""Streaming detokenization: turn token ids, as they are generated, into text deltas.

NOTE: decoding token by token is wrong for byte-level BPE. One character can span
several tokens ("日" is three UTF-8 bytes, often three tokens); decoding a partial
sequence yields U+FFFD, and decoders such as SentencePiece's strip a leading space only
at the start of a decode. So each push decodes a short window that starts at an earlier
character boundary, and emits only what extends past the text already emitted:

    ids:   ... | prefix ............ | read ........ | new ids
                 \\__ prefix_text __/
                 \\________________ text _________________/
    delta = text[len(prefix_text):]   -- emitted only if text does not end in U+FFFD

After an emission the window slides: prefix <- read, read <- end. A window that ends
in U+FFFD (an incomplete character) is held until more ids complete it, or until
``flush``. Work per push is O(window), independent of the stream length.
"""
from __future__ import annotations

from typing import Sequence

from services.shared.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-request text accumulator. Not thread-safe; one per sequence.

    Invariant: ``"".join(pushes) + flush() == tokenizer.decode(all_ids, skip_special_tokens)``."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # ids from the prefix offset on
        self._read = 0                # window index of the first id not yet emitted
        self._prefix_text = ""        # decode(self._window[:self._read])

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids`` and return the newly completed text ("" if none yet)."""
        if not new_ids:
            return ""
        self._window.extend(new_ids)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            # Nothing new (e.g. a skipped special token) or a character still incomplete.
            return ""
        delta = text[len(self._prefix_text):]
        # The end of the window is now a character boundary: slide the window to start
        # at the previous read offset, so the next decode keeps one chunk of context.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    def flush(self) -> str:
        """Return any held-back text (an incomplete character decodes as U+FFFD), as the
        full decode would; the detokenizer then starts from a clean boundary."""
        text = self._decode(self._window)
        delta = text[len(self._prefix_text):]
        self._window, self._read, self._prefix_text = [], 0, ""
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
