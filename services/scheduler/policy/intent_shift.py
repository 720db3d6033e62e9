"""Intent-shift detection: is a session's new turn far from its recent context?

NOTE: two signals sit behind the ``IntentDistance`` interface.
``EmbeddingDistance`` is the measured one: 1 − cosine of the cachestore's MiniLM
embeddings (``CacheStore.Embed``) of the detokenised context tail and turn head. On the
labelled set in ``tests/data/intent_shift_pairs.json`` it separates same-topic from
topic-change turns (``benchmarks/results/intent_shift.md``); ``HashedBowDistance``, the
cosine distance between hashed bags of token bigrams (~10 µs, no model), does not: it
is ~1.0 for almost every pair of short turns. The bigram signal stays as the fallback
when the embedding source is unreachable (``IntentSignalUnavailable``), with its own
threshold, since the two distances live on different scales. When the distance passes
the threshold the scheduler releases the session's kept KV that the new turn does not
reuse, instead of holding it until its TTL.

On the request path the embedding is a network call: ``decide_async`` awaits it with a
deadline (the scheduler's cachestore client, ``api/cachestore_port.py``), and a timeout is
treated like an unreachable cachestore: the fallback decides and the decision says why.
"""
from __future__ import annotations

import abc
import asyncio
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

DEFAULT_THRESHOLD = 0.9  # HashedBowDistance: the shipped value (see the results file for its precision)
DEFAULT_EMBEDDING_THRESHOLD = 0.80  # EmbeddingDistance: chosen on the labelled set (results file)


class IntentSignalUnavailable(Exception):
    """The distance's source (the cachestore's Embed RPC) did not answer."""


class IntentDistance(abc.ABC):
    name: str = "distance"

    @abc.abstractmethod
    def distance(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int]) -> float:
        """Distance in [0, 1] between recent context and a new turn; 0 = same topic.
        Modifies nothing; raises ``IntentSignalUnavailable`` when its source is down."""

    async def distance_async(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int]) -> float:
        """``distance`` for a caller on the event loop (a local signal just computes it)."""
        return self.distance(context_token_ids, turn_token_ids)


class HashedBowDistance(IntentDistance):
    name = "bigram"

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


EmbedTexts = Callable[[list[str]], Sequence[Sequence[float]]]  # texts -> one vector each
AsyncEmbedTexts = Callable[[list[str]], Awaitable[Sequence[Sequence[float]]]]  # the same, over the network
Detokenize = Callable[[Sequence[int]], str]  # token ids -> text, special tokens dropped


class EmbeddingDistance(IntentDistance):
    """1 − cosine of the embeddings of the context's last ``context_window`` tokens and
    the turn's first ``context_window`` tokens, clamped to [0, 1]. ``embed`` is any
    texts → vectors callable, ``embed_async`` the same awaited (the cachestore's Embed RPC
    behind a client; ``distance`` cannot use it, ``distance_async`` prefers it); any error
    either raises becomes ``IntentSignalUnavailable``."""

    name = "embedding"

    def __init__(self, embed: EmbedTexts | None, detokenize: Detokenize, context_window: int = 256, *,
                 embed_async: AsyncEmbedTexts | None = None) -> None:
        if embed is None and embed_async is None:
            raise ValueError("EmbeddingDistance needs embed or embed_async")
        self.embed = embed
        self.embed_async = embed_async
        self.detokenize = detokenize
        self.context_window = context_window

    def _texts(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int]) -> list[str] | None:
        texts = [self.detokenize(list(context_token_ids[-self.context_window:])),
                 self.detokenize(list(turn_token_ids[: self.context_window]))]
        return texts if texts[0].strip() and texts[1].strip() else None  # nothing to compare: never a shift

    def distance(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int]) -> float:
        texts = self._texts(context_token_ids, turn_token_ids)
        if texts is None:
            return 0.0
        if self.embed is None:
            raise IntentSignalUnavailable("only an awaitable embedder is configured")
        try:
            a, b = self.embed(texts)
        except Exception as e:  # the RPC's failure modes are many; all mean "no signal now"
            raise IntentSignalUnavailable(str(e) or type(e).__name__) from e
        return _cosine_distance(a, b)

    async def distance_async(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int]) -> float:
        if self.embed_async is None:
            return self.distance(context_token_ids, turn_token_ids)
        texts = self._texts(context_token_ids, turn_token_ids)
        if texts is None:
            return 0.0
        try:
            a, b = await self.embed_async(texts)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise IntentSignalUnavailable(str(e) or type(e).__name__) from e
        return _cosine_distance(a, b)


def _cosine_distance(a: Sequence[float], b: Sequence[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    if norm == 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - sum(x * y for x, y in zip(a, b)) / norm))


@dataclass(frozen=True)
class IntentShiftDecision:
    shifted: bool
    distance: float  # of the signal used; 0.0 when the turn was too short to judge
    threshold: float  # that signal's threshold
    signal: str  # "embedding", "bigram", ... or "none" (not judged)
    fallback_reason: str = ""  # why the primary signal was not used: "unavailable", "timeout" ("" = it was)


_NOT_JUDGED = IntentShiftDecision(False, 0.0, 0.0, "none")


class IntentShiftDetector:
    """Threshold over an ``IntentDistance``, with an optional fallback signal (and its
    own threshold) used when the primary raises ``IntentSignalUnavailable``."""

    def __init__(self, metric: IntentDistance | None = None, threshold: float = DEFAULT_THRESHOLD,
                 min_turn_tokens: int = 8, fallback: IntentDistance | None = None,
                 fallback_threshold: float = DEFAULT_THRESHOLD) -> None:
        for t in (threshold, fallback_threshold):
            if not 0 < t <= 1:
                raise ValueError("threshold must be in (0, 1]")
        self.metric = metric or HashedBowDistance()
        self.threshold = threshold
        self.min_turn_tokens = min_turn_tokens
        self.fallback = fallback
        self.fallback_threshold = fallback_threshold

    def decide(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int]) -> IntentShiftDecision:
        """Judge a turn; modifies nothing. With no fallback an unavailable signal is
        "no shift" (keeping KV is the safe default)."""
        if len(turn_token_ids) < self.min_turn_tokens or not context_token_ids:
            return _NOT_JUDGED
        try:
            d = self.metric.distance(context_token_ids, turn_token_ids)
            return IntentShiftDecision(d >= self.threshold, d, self.threshold, self.metric.name)
        except IntentSignalUnavailable:
            return self._fall_back(context_token_ids, turn_token_ids, "unavailable")

    async def decide_async(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int],
                           timeout_s: float) -> IntentShiftDecision:
        """``decide`` with the primary signal awaited for at most ``timeout_s``; past it,
        or when its source is down, the fallback decides (``fallback_reason`` says which).
        Modifies nothing."""
        if len(turn_token_ids) < self.min_turn_tokens or not context_token_ids:
            return _NOT_JUDGED
        try:
            d = await asyncio.wait_for(self.metric.distance_async(context_token_ids, turn_token_ids), timeout_s)
            return IntentShiftDecision(d >= self.threshold, d, self.threshold, self.metric.name)
        except IntentSignalUnavailable:
            return self._fall_back(context_token_ids, turn_token_ids, "unavailable")
        except TimeoutError:
            return self._fall_back(context_token_ids, turn_token_ids, "timeout")

    def _fall_back(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int],
                   reason: str) -> IntentShiftDecision:
        if self.fallback is None:
            return replace(_NOT_JUDGED, fallback_reason=reason)
        d = self.fallback.distance(context_token_ids, turn_token_ids)
        return IntentShiftDecision(d >= self.fallback_threshold, d, self.fallback_threshold, self.fallback.name,
                                   reason)

    def shifted(self, context_token_ids: Sequence[int], turn_token_ids: Sequence[int]) -> bool:
        return self.decide(context_token_ids, turn_token_ids).shifted


def make_intent_detector(embed: EmbedTexts | None = None, detokenize: Detokenize | None = None,
                         embedding_threshold: float = DEFAULT_EMBEDDING_THRESHOLD,
                         bigram_threshold: float = DEFAULT_THRESHOLD, *,
                         embed_async: AsyncEmbedTexts | None = None) -> IntentShiftDetector:
    """Embeddings with the bigram fallback when ``detokenize`` and an embedder (``embed``
    or ``embed_async``) are given, else bigrams alone."""
    if detokenize is None or (embed is None and embed_async is None):
        return IntentShiftDetector(HashedBowDistance(), bigram_threshold)
    return IntentShiftDetector(EmbeddingDistance(embed, detokenize, embed_async=embed_async), embedding_threshold,
                               fallback=HashedBowDistance(), fallback_threshold=bigram_threshold)
