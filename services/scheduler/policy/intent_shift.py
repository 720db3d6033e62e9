"""Intent-shift detection: is a session's new turn far from its recent context?

NOTE: the signal today is a cheap one that needs no model: the cosine distance between
hashed bags of token bigrams (``HashedBowDistance``; ~10 µs for a few hundred tokens).
It is behind the ``IntentDistance`` interface so the cachestore's embedding RPC
(``CacheStore.Embed``, issue 6) can replace it without touching the caller. When the
distance passes the threshold the scheduler releases the session's kept KV that the new
turn does not reuse, instead of holding it until its TTL.
"""
from __future__ import annotations

import abc
import math
from collections import Counter
from collections.abc import Sequence


class IntentDistance(abc.ABC):
    @abc.abstractmethod
    def distance(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int]) -> float:
        """Distance in [0, 1] between recent context and a new turn; 0 = same topic.
        Pure."""


class HashedBowDistance(IntentDistance):
    def __init__(self, num_buckets: int = 4096, context_window: int = 256) -> None:
        self.num_buckets = num_buckets
        self.context_window = context_window

    def _bag(self, ids: Sequence[int]) -> Counter:
        bag = Counter(hash((a, b)) % self.num_buckets for a, b in zip(ids, ids[1:]))  # ints hash stably
        if not bag and ids:
            bag[ids[0] % self.num_buckets] = 1
        return bag

    def distance(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int]) -> float:
        a = self._bag(list(context_token_ids[-self.context_window:]))
        b = self._bag(list(turn_token_ids[: self.context_window]))
        if not a or not b:
            return 0.0
        dot = sum(v * b.get(k, 0) for k, v in a.items())
        norm = math.sqrt(sum(v * v for v in a.values())) * math.sqrt(sum(v * v for v in b.values()))
        return 1.0 - dot / norm


class IntentShiftDetector:
    """Threshold over an ``IntentDistance``."""

    def __init__(self, metric: IntentDistance | None = None, threshold: float = 0.9, min_turn_tokens: int = 8) -> None:
        if not 0 < threshold <= 1:
            raise ValueError("threshold must be in (0, 1]")
        self.metric = metric or HashedBowDistance()
        self.threshold = threshold
        self.min_turn_tokens = min_turn_tokens

    def shifted(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int]) -> bool:
        if len(turn_token_ids) < self.min_turn_tokens or not context_token_ids:
            return False
        return self.metric.distance(context_token_ids, turn_token_ids) >= self.threshold
