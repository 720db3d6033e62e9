"""The embedder and the semantic index together, for asyncio callers: embedding runs in
a worker thread (tens of milliseconds on CPU), never on the event loop."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from services.cachestore.embedder import EMBEDDING_DIM, MODEL_NAME, MiniLmEmbedder
from services.cachestore.errors import InvalidQueryError
from services.cachestore.semantic import DEFAULT_THRESHOLD, SemanticHit, SemanticIndex, SemanticKind

MAX_TEXTS = 256  # per Embed call
MAX_TEXT_CHARS = 64 * 1024


class SemanticService:
    def __init__(self, embedder: MiniLmEmbedder | None = None, index: SemanticIndex | None = None) -> None:
        self.embedder = embedder or MiniLmEmbedder()
        self.index = index or SemanticIndex(DEFAULT_THRESHOLD)
        self.dim = EMBEDDING_DIM
        self.model_name = MODEL_NAME

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
