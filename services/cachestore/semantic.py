"""Semantic index: text embeddings → remembered token sequences, per tenant.

Two uses share it (``kind``): the semantic response cache (a deterministic request's
output, found by a similar prompt) and similar-intent prefetch (a session's first-turn
prompt tokens, found by a similar first turn of a new session). Entries are scoped by
``(tenant, kind, scope)``: a tenant never sees another's entries, and ``scope`` (model
id + sampling parameters for responses) must match exactly, so a hit is only ever an
answer the same request could have produced.

A lookup is a matrix-vector product over the scope's entries; each scope keeps at most
``max_entries`` (oldest dropped first), which bounds both memory and lookup time.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

import torch

# Chosen on the built-in paraphrase set (paraphrase_set.py): the lowest threshold with
# no false positive there, plus a margin; see docs/architecture.md.
DEFAULT_THRESHOLD = 0.92


class SemanticKind(enum.Enum):
    RESPONSE = "response"
    SESSION_PREFIX = "session_prefix"


@dataclass(frozen=True)
class SemanticHit:
    similarity: float
    token_ids: tuple[int, ...]
    text: str


@dataclass
class _Scope:
    texts: list[str] = field(default_factory=list)
    token_ids: list[tuple[int, ...]] = field(default_factory=list)
    vectors: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 0)))


class SemanticIndex:
    """Thread-safe. ``store`` / ``lookup`` take an already computed unit vector."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, max_entries: int = 10_000) -> None:
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [-1, 1], got {threshold}")
        if max_entries <= 0:
            raise ValueError("max_entries must be > 0")
        self.threshold = threshold
        self.max_entries = max_entries
        self._scopes: dict[tuple[str, SemanticKind, str], _Scope] = {}
        self._lock = threading.Lock()

    def store(self, tenant: str, kind: SemanticKind, scope: str, text: str, vector: torch.Tensor,
              token_ids: tuple[int, ...]) -> int:
        """Remember ``token_ids`` under ``text``; an identical text replaces its entry.
        Returns the scope's number of entries."""
        vector = vector.reshape(1, -1).float()
        with self._lock:
            s = self._scopes.setdefault((tenant, kind, scope), _Scope())
            if text in s.texts:
                i = s.texts.index(text)
                del s.texts[i], s.token_ids[i]
                s.vectors = torch.cat([s.vectors[:i], s.vectors[i + 1:]])
            s.texts.append(text)
            s.token_ids.append(tuple(token_ids))
            s.vectors = vector if s.vectors.numel() == 0 else torch.cat([s.vectors, vector])
            if len(s.texts) > self.max_entries:
                drop = len(s.texts) - self.max_entries
                del s.texts[:drop], s.token_ids[:drop]
                s.vectors = s.vectors[drop:]
            return len(s.texts)

    def best(self, tenant: str, kind: SemanticKind, scope: str, vector: torch.Tensor) -> SemanticHit | None:
        """The most similar entry of the tenant's scope regardless of threshold (None
        when the scope is empty). Does not modify the index."""
        with self._lock:
            s = self._scopes.get((tenant, kind, scope))
            if s is None or not s.texts:
                return None
            sims = s.vectors @ vector.reshape(-1).float()  # [entries]
            i = int(torch.argmax(sims))
            return SemanticHit(float(sims[i]), s.token_ids[i], s.texts[i])

    def lookup(self, tenant: str, kind: SemanticKind, scope: str, vector: torch.Tensor) -> SemanticHit | None:
        """The most similar entry if it clears the threshold, else None."""
        hit = self.best(tenant, kind, scope, vector)
        return hit if hit is not None and hit.similarity >= self.threshold else None

    def num_entries(self, tenant: str, kind: SemanticKind, scope: str) -> int:
        with self._lock:
            s = self._scopes.get((tenant, kind, scope))
            return len(s.texts) if s else 0
