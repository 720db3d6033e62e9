"""The embedder and the semantic index together, for asyncio callers: embedding runs in
a worker thread (tens of milliseconds on CPU), never on the event loop.

``warm_up`` loads the model at start (seconds on CPU): until it returns the cachestore
reports NOT_SERVING, so a fresh mesh does not answer semantic lookups with misses while
the model is still loading."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import structlog
import torch

from services.cachestore.embedder import EMBEDDING_DIM, MODEL_NAME, MiniLmEmbedder
from services.cachestore.errors import InvalidQueryError
from services.cachestore.semantic import DEFAULT_THRESHOLD, SemanticHit, SemanticIndex, SemanticKind

log = structlog.get_logger(__name__)

MAX_TEXTS = 256  # per Embed call
MAX_TEXT_CHARS = 64 * 1024


class SemanticService:
    def __init__(self, embedder: MiniLmEmbedder | None = None, index: SemanticIndex | None = None) -> None:
        self.embedder = embedder or MiniLmEmbedder()
        self.index = index or SemanticIndex(DEFAULT_THRESHOLD)
        self.dim = EMBEDDING_DIM
        self.model_name = MODEL_NAME

    @property
    def ready(self) -> bool:
        """Whether the embedding model is loaded (lookups will not wait for it)."""
        return self.embedder.loaded

    async def warm_up(self) -> float:
        """Load the embedding model in a worker thread; returns the seconds it took and
        logs ``embedding_model_loaded``. Idempotent."""
        start = time.perf_counter()
        await asyncio.to_thread(self.embedder.load)
        load_s = time.perf_counter() - start
        log.info("embedding_model_loaded", model=self.model_name, load_ms=round(load_s * 1000, 1))
        return load_s

    @staticmethod
    def _check(texts: Sequence[str]) -> None:
        if len(texts) > MAX_TEXTS:
            raise InvalidQueryError("texts", f"at most {MAX_TEXTS} texts per call, got {len(texts)}")
        for t in texts:
            if len(t) > MAX_TEXT_CHARS:
                raise InvalidQueryError("text", f"longer than {MAX_TEXT_CHARS} characters")

    async def embed(self, texts: Sequence[str]) -> torch.Tensor:
        self._check(texts)
        return await asyncio.to_thread(self.embedder.embed, list(texts))

    async def embed_counted(self, texts: Sequence[str]) -> tuple[torch.Tensor, list[int]]:
        """Vectors and the word pieces read of each text (``MiniLmEmbedder.embed_counted``)."""
        self._check(texts)
        return await asyncio.to_thread(self.embedder.embed_counted, list(texts))

    async def similarity(self, text_a: str, text_b: str) -> float:
        e = await self.embed([text_a, text_b])
        return float(e[0] @ e[1])

    async def best(self, tenant: str, kind: SemanticKind, scope: str, text: str) -> SemanticHit | None:
        if self.index.num_entries(tenant, kind, scope) == 0:
            return None  # nothing to compare against: skip the embedding
        vector = (await self.embed([text]))[0]
        return self.index.best(tenant, kind, scope, vector)

    async def store(self, tenant: str, kind: SemanticKind, scope: str, text: str, token_ids: tuple[int, ...]) -> int:
        vector = (await self.embed([text]))[0]
        return self.index.store(tenant, kind, scope, text, vector, token_ids)
