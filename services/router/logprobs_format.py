"""Log-probabilities in OpenAI's two shapes, from the ids and logprobs of ``Delta`` events.

    chat         choices[].logprobs = {"content": [{token, logprob, bytes,
                                                    top_logprobs: [{token, logprob, bytes}]}]}
    completions  choices[].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}],
                                       text_offset}

A token's text is the tokenizer's decoded piece for its id alone (special tokens kept),
and ``bytes`` its UTF-8 bytes: a piece that is part of a multi-byte character decodes to
U+FFFD, as in vLLM. ``text_offset`` counts characters of those pieces from the start of
the choice's text (the echoed prompt's pieces first, with ``echo``); it matches the text
exactly when every piece decodes on its own.

The completions' ``top_logprobs`` dict holds the k alternatives plus the chosen token (as
OpenAI's legacy API did); the first prompt token has no logprob (nothing precedes it):
its entries are ``null``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.shared.tokenizer import Tokenizer

Alternatives = Sequence[tuple[int, float]]
_MAX_CACHED_PIECES = 1 << 16


class TokenText:
    """Token id -> its text piece (cached: a stream asks for the same ids again and again)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        text = self._pieces.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._pieces) < _MAX_CACHED_PIECES:
                self._pieces[token_id] = text
        return text

    def entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self.piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _at(values: Sequence[Any], i: int, default: Any) -> Any:
    return values[i] if i < len(values) else default


def chat_logprobs(text: TokenText, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[Alternatives]) -> list[dict[str, Any]]:
    """``logprobs.content`` entries of these tokens (chat)."""
    out = []
    for i, t in enumerate(token_ids):
        entry = text.entry(t, _at(logprobs, i, None))
        entry["top_logprobs"] = [text.entry(a, lp) for a, lp in _at(top, i, ())]
        out.append(entry)
    return out


class CompletionLogprobs:
    """One completions choice's logprobs, built chunk by chunk (offsets carry over)."""

    def __init__(self, text: TokenText) -> None:
        self.text = text
        self.offset = 0
        self.body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add_prompt(self, prompt_ids: Sequence[int], logprobs: Sequence[float],
                   top: Sequence[Alternatives]) -> dict[str, list]:
        """The echoed prompt's tokens; ``logprobs``/``top`` cover every token after the first."""
        part = self._part([prompt_ids[0]], [None], [None]) if prompt_ids else self._part([], [], [])
        rest = self._part(prompt_ids[1:], logprobs, top)
        return {k: part[k] + rest[k] for k in part}

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Alternatives]) -> dict[str, list]:
        """Generated tokens; returns just this part (a stream chunk's logprobs)."""
        return self._part(token_ids, logprobs, top)

    def _part(self, token_ids: Sequence[int], logprobs: Sequence[float | None],
              top: Sequence[Alternatives | None]) -> dict[str, list]:
        part: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, t in enumerate(token_ids):
            piece, lp, alts = self.text.piece(t), _at(logprobs, i, None), _at(top, i, ())
            part["tokens"].append(piece)
            part["token_logprobs"].append(lp)
            part["top_logprobs"].append(None if alts is None else
                                        {**{self.text.piece(a): alp for a, alp in alts},
                                         **({piece: lp} if lp is not None else {})})
            part["text_offset"].append(self.offset)
            self.offset += len(piece)
        for k, v in part.items():
            self.body[k].extend(v)
        return part
