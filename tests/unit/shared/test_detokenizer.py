"""Streaming detokenization: deltas add up to the full decode, whatever the chunking."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.shared.detokenizer import IncrementalDetokenizer
from services.shared.tokenizer import Tokenizer
from weft.testing.tiny_model import make_tiny_checkpoint

MODEL_VOCAB = 1024  # the tiny preset; qwen2's tokenizer covers fewer ids than this


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    ckpt: Path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), "tiny", request.param)
    return Tokenizer.from_dir(ckpt)


def stream(tokenizer: Tokenizer, chunks: list[list[int]], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    return [detok.push(chunk) for chunk in chunks] + [detok.flush()]


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, MODEL_VOCAB - 1), max_size=40),
       cuts=st.lists(st.integers(0, 40), max_size=12),
       skip=st.booleans())
def test_any_ids_in_any_chunking_concatenate_to_the_full_decode(tokenizer, ids, cuts, skip):
    deltas = stream(tokenizer, chunked(ids, cuts), skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=30), cuts=st.lists(st.integers(0, 60), max_size=10))
def test_valid_text_streams_without_replacement_characters(tokenizer, text, cuts):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, chunked(ids, cuts))
    assert "".join(deltas) == tokenizer.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("語", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits this rare character across tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "語"
    assert detok.flush() == ""


def test_incomplete_character_at_end_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("語", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == tokenizer.decode(ids[:1]) == "\ufffd"


def test_special_tokens_are_skipped_or_kept_as_asked(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tokenizer, [[i] for i in ids], skip=True)) == "hi"
    assert "".join(stream(tokenizer, [[i] for i in ids], skip=False)) == "<|im_start|>hi<|im_end|>"


class CountingTokenizer:
    """Delegates to a Tokenizer, recording the length of every decoded id list."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.decoded_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_push_does_not_grow_with_stream_length(tokenizer):
    ids = tokenizer.encode("The engine streams tokens back to the caller. 日本語 🙂 " * 60,
                           add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert len(ids) > 500 and max(counting.decoded_lengths) <= 8
